"""Hugging Face as a source: ``hf:`` model specs, their resolution to one commit, and byte ranges read
from the hub (or the mirror ``HF_ENDPOINT`` names) with HTTP ``Range``, each one checked.

::

    model = resolve(parse_spec("hf:org/repo:Q4_K_M"))      # the commit, each file's size and LFS sha256
    hub = HubReader(model)
    hub.check()                                            # the server serves that commit (a stale mirror fails)
    manifest = hash_model(hub)                             # the first holder: the whole file, checked
    report = await fetch_from_hub(hub, sparse, chunks)     # a volunteer: its own chunks, checked

Everything goes through ``huggingface_hub``: ``HfApi.model_info`` (with the
files' metadata) resolves a revision to a commit and gives each file's size and
LFS sha256; ``hf_hub_url`` names a file at that commit; ``get_hf_file_metadata``
says which commit and which blob a server serves there; the library's HTTP
session (``get_session``, its token headers and ``hf_raise_for_status``) reads
byte ranges. Nothing here knows the hub's host: the library's endpoint (its
default, ``HF_ENDPOINT``) is the one used. The library is imported where it is
used: importing it takes 0.5-0.9 s here, which every other command would pay.

What a range is checked against (DESIGN, "Model distribution"): the hub pins
a file at a commit by its size and sha256, and a range cannot be checked
against a whole file's hash. So the first holder of a hub model reads the whole
file once (``hash_model``), checks it against that sha256 and builds the same
manifest (the same model id) a local copy has; every range fetched after, by
anyone, is checked chunk by chunk against that manifest, and the manifest's
sizes and header against what the hub serves at the pinned commit.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import trio

from meshd.fetch.fetcher import FetchFailed, FetchProgress, FetchReport
from meshd.store.gguf_header import GGUFError, GGUFLayout, read_layout
from meshd.store.manifest import CACHE_SUFFIX, CHUNK_SIZE, Chunk, Manifest, ManifestError, Part, TensorEntry
from meshd.store.plan import MIN_RATE
from meshd.store.sparse import BadChunk, SparseFile
from meshd.store.split import (
    MAX_PARTS,
    SPLIT_TENSORS,
    SplitError,
    check_set,
    part_name,
    set_prefix,
    shown_name,
    split_count,
)
from wire.fetch import MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    import httpx2

log = logging.getLogger(__name__)
# huggingface_hub's transport logs every request at info: a range fetch makes one a chunk (thousands for a
# big model), which would bury the daemon's own lines.
logging.getLogger("httpx2").setLevel(logging.WARNING)

PREFIX = "hf:"
# A repo id as the hub allows one: ORG/NAME, letters, digits, "-", "_", "." (at most 96 characters each).
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
_QUANT = re.compile(r"^[A-Za-z0-9][\w.-]{0,63}$")
_REVISION = re.compile(r"^[\w./-]{1,255}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# llama-server's choice when a repo has several quants and none is named.
DEFAULT_QUANT = "Q4_K_M"
# A header of unknown size is read in growing prefixes, from this, doubling: most are under 8 MiB (a
# 256k-token vocabulary is ~6 MiB), and what is read past the header is at most as much again; none read
# is larger than MAX_HEADER_BYTES.
_FIRST_HEADER_READ = 64 << 10
MAX_HEADER_BYTES = 256 << 20
# Bytes read a request while hashing a whole file: one long GET would do, but ranges let a broken
# connection resume where it broke.
_PASS_READ = 16 << 20
# Of an error's body, what is read for its message (the hub's are a line of JSON).
_ERROR_BODY = 64 << 10
# Requests to the hub at once by one fetch: 4 connections keep a link busy while each waits on its first
# byte.
HUB_CONCURRENCY = 4
# A fetch asks for the chunks it lacks in runs: those one after another in the manifest and a file, apart from
# at most _GAP_BYTES between (GGUF aligns each tensor to 32 bytes, or general.alignment), in one request of at most
# _RUN_BYTES, read and checked a chunk at a time (``_Run``), where it asked for each 4 MiB chunk on its own.
_RUN_BYTES = 32 << 20
_GAP_BYTES = 64 << 10


class HubError(Exception):
    """A hub model that cannot be named, found, reached or trusted: the message is one line for a user."""


class HubSpecError(HubError, ValueError):
    """An ``hf:`` spec that is not one."""


@dataclass(frozen=True)
class HubSpec:
    repo: str
    # A file's path in the repo (any part of a set names the set) or a quant to pick files by; at most one.
    file: str | None = None
    quant: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        what = f"/{self.file}" if self.file else f":{self.quant}" if self.quant else ""
        return f"{PREFIX}{self.repo}{what}" + (f"@{self.revision}" if self.revision else "")


def is_spec(text: str) -> bool:
    return text.startswith(PREFIX)


def parse_spec(text: str) -> HubSpec:
    """``hf:ORG/REPO[:QUANT][@REV]`` or ``hf:ORG/REPO/PATH.gguf[@REV]`` (``@REV`` may come before ``:QUANT``)."""
    if not is_spec(text):
        raise HubSpecError(f"'{text}' is not an hf: model (hf:ORG/REPO[:QUANT][@REV] or hf:ORG/REPO/FILE.gguf)")
    body, revision, quant = text[len(PREFIX):], None, None
    if "@" in body:
        body, revision = body.rsplit("@", 1)
        if ":" in revision:
            revision, quant = revision.split(":", 1)
        if not _REVISION.match(revision) or ".." in revision:
            raise HubSpecError(f"'{text}': '{revision}' is not a revision (a branch, a tag or a commit)")
    if ":" in body:
        if quant is not None:
            raise HubSpecError(f"'{text}' names two quants")
        body, quant = body.split(":", 1)
    if quant is not None and not _QUANT.match(quant):
        raise HubSpecError(f"'{text}': '{quant}' is not a quant name such as Q4_K_M")
    pieces = body.split("/")
    repo, file = "/".join(pieces[:2]), "/".join(pieces[2:]) or None
    if not _REPO.match(repo) or ".." in repo:
        raise HubSpecError(f"'{text}': '{repo}' is not a repository (ORG/REPO)")
    if file is not None:
        if quant is not None:
            raise HubSpecError(f"'{text}' names a file and a quant: give one")
        path = PurePosixPath(file)
        if not file.endswith(".gguf") or any(p in ("", ".", "..") for p in file.split("/")) or path.is_absolute():
            raise HubSpecError(f"'{text}': '{file}' is not a .gguf file's path in the repository")
    return HubSpec(repo, file, quant, revision)


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name


@dataclass(frozen=True)
class HubModel:
    """A model on the hub at one commit: its file, or every part of its set in order."""

    repo: str
    commit: str
    files: tuple[HubFile, ...]
    endpoint: str
    token: str | bool | None = None

    @property
    def name(self) -> str:
        """The file name it is known by, as a local copy is (``shown_name``): the file's, or the set's less the
        part numbers."""
        return shown_name(Path(self.files[0].name))

    @property
    def where(self) -> str:
        return f"{self.repo}@{self.commit[:12]}"

    def url(self, part: int) -> str:
        from huggingface_hub import hf_hub_url

        url: str = hf_hub_url(self.repo, self.files[part].path, revision=self.commit, endpoint=self.endpoint)
        return url


def _endpoint(endpoint: str | None) -> str:
    """The hub or mirror to use: the one given, else HF_ENDPOINT as it is now (the library reads it once,
    at its import), else the library's default."""
    from huggingface_hub import constants

    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _library_error(exc: BaseException, spec: HubSpec, endpoint: str) -> HubError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return HubError(f"{spec.repo} is gated: accept its terms on the hub and give a token (HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"no repository {spec.repo} at {endpoint} (or it is private: give a token, HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{spec.repo} has no revision '{spec.revision}' at {endpoint}")
    if isinstance(exc, HfHubHTTPError):
        return HubError(f"{endpoint} refused {spec.repo}: {str(exc).splitlines()[0]}")
    return HubError(f"cannot reach the hub at {endpoint}: {type(exc).__name__}: {exc}".splitlines()[0])


def _transport_errors() -> tuple[type[BaseException], ...]:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError, httpx2.HTTPError, OSError)


def resolve(spec: HubSpec, *, token: str | bool | None = None, endpoint: str | None = None,
            timeout: float = 30.0) -> HubModel:
    """The commit ``spec``'s revision is at and the files it names there, each with its size and LFS sha256.

    HubError, one line, for a repo, revision or file that is not there, a hub that cannot be reached, or
    a file the hub gives no sha256 of (not in LFS: nothing to check it against)."""
    from huggingface_hub import HfApi

    where = _endpoint(endpoint)
    try:
        info = HfApi(endpoint=where, token=token).model_info(spec.repo, revision=spec.revision, files_metadata=True,
                                                             timeout=timeout)
    except _transport_errors() as exc:
        raise _library_error(exc, spec, where) from None
    commit = info.sha or ""
    if not _COMMIT.match(commit):
        raise HubError(f"{where} gave no commit for {spec.repo}@{spec.revision or 'main'}")
    if spec.revision is not None and _COMMIT.match(spec.revision) and spec.revision != commit:
        # a commit named is a pin: a server answering with another serves another revision
        raise HubError(f"{where} serves {spec.repo} at commit {commit[:12]}, not the {spec.revision[:12]} named "
                       "(a stale or wrong mirror)")
    siblings = {s.rfilename: s for s in info.siblings or ()}
    paths = _pick(spec, sorted(siblings), f"{spec.repo}@{commit[:12]}")
    files = []
    for path in paths:
        sibling = siblings[path]
        lfs = sibling.lfs
        if lfs is None or not _SHA256.match(str(lfs.sha256)) or not isinstance(lfs.size, int) or lfs.size <= 0:
            raise HubError(f"{where} gives no LFS sha256 and size for {path} in {spec.repo}: its bytes could not be "
                           "checked")
        files.append(HubFile(path, lfs.size, str(lfs.sha256)))
    return HubModel(spec.repo, commit, tuple(files), where, token)


def _is_model(path: str) -> bool:
    name = PurePosixPath(path).name.lower()
    return path.endswith(".gguf") and "mmproj" not in name


def _group(path: str) -> str:
    """A set's files group by the set's name; a file is a group of its own."""
    prefix = set_prefix(Path(path))
    return str(PurePosixPath(path).with_name(prefix + ".gguf")) if prefix is not None else path


def _set_of(path: str, files: Sequence[str], where: str) -> list[str]:
    """``path`` or, for a part of a set, every part of it, in order (HubError naming one missing)."""
    found = re.match(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", PurePosixPath(path).name)
    if found is None:
        return [path]
    count = int(found["count"])
    if not 1 <= count <= MAX_PARTS:
        raise HubError(f"{path} says its set has {count} parts; meshd takes at most {MAX_PARTS}")
    parts = [str(PurePosixPath(path).with_name(part_name(found["prefix"], i, count))) for i in range(count)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise HubError(f"part {parts.index(missing[0]) + 1} of {count} of {found['prefix']} is not in {where}: "
                       f"{missing[0]}")
    return parts


def _pick(spec: HubSpec, files: Sequence[str], where: str) -> list[str]:
    if spec.file is not None:
        if spec.file not in files:
            raise HubError(f"no file {spec.file} in {where}")
        return _set_of(spec.file, files, where)
    models = [f for f in files if _is_model(f)]
    groups: dict[str, list[str]] = {}
    for f in models:
        groups.setdefault(_group(f), []).append(f)
    if not groups:
        raise HubError(f"{where} holds no GGUF model file")
    quant = spec.quant or (DEFAULT_QUANT if len(groups) > 1 else None)
    if quant is not None:
        # the quant as a whole word of the name: Q4_K names neither Q4_K_M nor Q4_K_S
        word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
        groups = {g: fs for g, fs in groups.items() if word.search(PurePosixPath(g).name)}
    shown = ", ".join(sorted(PurePosixPath(g).name for g in groups))
    if len(groups) != 1:
        if not groups:
            names = ", ".join(sorted({PurePosixPath(_group(f)).name for f in models}))
            raise HubError(f"no {quant} file in {where} (it has {names})" if spec.quant else
                           f"{where} has several models and no {DEFAULT_QUANT}: name one with :QUANT ({names})")
        raise HubError(f"'{spec}' names several files of {where} ({shown}): name one with hf:{spec.repo}/FILE.gguf")
    chosen = next(iter(groups.values()))
    return _set_of(sorted(chosen)[0], files, where)


# ----- reading bytes


def _response_total(content_range: str | None) -> tuple[int, int, int] | None:
    found = re.match(r"^bytes (\d+)-(\d+)/(\d+)$", content_range or "")
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def _bounded(response: httpx2.Response, limit: int) -> bytes:
    """A streamed body's bytes, at most ``limit`` of them (reading stops there)."""
    pieces, held = [], 0
    for piece in response.iter_bytes():
        pieces.append(piece)
        held += len(piece)
        if held >= limit:
            break
    # one copy of the body (the last piece may run past the limit: a few KiB more held for a moment)
    data = b"".join(pieces)
    return data[:limit] if held > limit else data


class HubReader:
    """Byte ranges of a hub model's files at its commit, through the library's HTTP session.

    Blocking: the trio shell calls it in worker threads (the session is thread-safe)."""

    def __init__(self, model: HubModel, timeout: float = 30.0) -> None:
        self.model = model
        self.timeout = timeout
        # Bytes read from the server, for reports.
        self.read_bytes = 0

    def _headers(self, start: int, end: int) -> dict[str, str]:
        # the library's headers for a token (HF_TOKEN, a login, or the one given); not in its __all__
        from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

        headers: dict[str, str] = build_hf_headers(token=self.model.token)
        headers["Range"] = f"bytes={start}-{end - 1}"
        headers["Accept-Encoding"] = "identity"
        return headers

    def check(self) -> None:
        """That the server serves each file at the pinned commit as the commit's tree says (size and sha256):
        HubError naming the file otherwise (a stale mirror serves another revision's)."""
        from huggingface_hub import get_hf_file_metadata

        model = self.model
        for i, f in enumerate(model.files):
            try:
                meta = get_hf_file_metadata(self.model.url(i), token=model.token, timeout=self.timeout,
                                            endpoint=model.endpoint)
            except _transport_errors() as exc:
                raise HubError(f"cannot read {f.path} of {model.where} from {model.endpoint}: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            if meta.commit_hash is not None and meta.commit_hash != model.commit:
                raise HubError(f"{model.endpoint} serves {f.path} of commit {meta.commit_hash[:12]}, not the pinned "
                               f"{model.commit[:12]} (a stale mirror)")
            if (meta.etag is not None and meta.etag != f.sha256) or (meta.size is not None and meta.size != f.size):
                raise HubError(f"{model.endpoint} serves {f.path} as {meta.size} bytes of sha256 "
                               f"{(meta.etag or '?')[:12]}, not the {f.size} bytes of {f.sha256[:12]} commit "
                               f"{model.commit[:12]} pins (a stale or lying mirror)")

    def open(self, part: int, start: int, end: int) -> RangeBody:
        """The body of a request for bytes [start, end) of file ``part``, its status, range and commit checked
        (HubError otherwise), to be read as it comes (``RangeBody``); the caller closes it."""
        import httpx2
        from huggingface_hub import get_session, hf_raise_for_status

        f = self.model.files[part]
        if not 0 <= start < end <= f.size:
            raise ValueError(f"bytes {start}-{end} are not within {f.path}")
        try:
            session = get_session()
            request = session.build_request("GET", self.model.url(part), headers=self._headers(start, end),
                                            timeout=self.timeout)
            response = session.send(request, stream=True, follow_redirects=True)
        except _transport_errors() as exc:
            raise self._unreadable(part, exc) from None
        try:
            if response.status_code >= 400:
                # the library's error from the status and headers, and as much of the body as an error's
                # message takes
                hf_raise_for_status(httpx2.Response(response.status_code, headers=response.headers,
                                                    content=_bounded(response, _ERROR_BODY),
                                                    request=response.request))
            found = _response_total(response.headers.get("Content-Range"))
            if response.status_code != 206 or found != (start, end - 1, f.size):
                raise HubError(f"{self.model.endpoint} answered bytes {start}-{end - 1} of {f.path} with "
                               f"{response.status_code} {response.headers.get('Content-Range')!r}")
            commit = response.headers.get("X-Repo-Commit")
            if commit is not None and commit != self.model.commit:
                raise HubError(f"{self.model.endpoint} serves {f.path} of commit {commit[:12]}, not the pinned "
                               f"{self.model.commit[:12]} (a stale mirror)")
        except BaseException as exc:
            response.close()
            if isinstance(exc, _transport_errors()):
                raise self._unreadable(part, exc) from None
            raise
        return RangeBody(self, part, start, end, response)

    def _unreadable(self, part: int, exc: BaseException) -> HubError:
        return HubError(f"cannot read {self.model.files[part].path} of {self.model.where} from {self.model.endpoint}: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    def read(self, part: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of file ``part``: HubError if the server sends anything else. The body is read as it
        comes and no further than asked (a server sending more, whatever its headers say, is cut off there):
        a hostile mirror's endless body costs one range's memory."""
        with self.open(part, start, end) as body:
            data = b"".join(body.take(end - start))
            body.finish()
        return data

    def header(self, part: int) -> tuple[bytes, GGUFLayout]:
        """File ``part``'s header bytes (everything before its tensor data) and its layout, read in growing
        prefixes by the bounded parser (the header came from a server)."""
        f = self.model.files[part]
        want = min(_FIRST_HEADER_READ, f.size)
        data = b""
        while True:
            data += self.read(part, len(data), want)
            try:
                layout = read_layout(io.BytesIO(data))
            except GGUFError as exc:
                if want >= min(f.size, MAX_HEADER_BYTES):
                    raise HubError(f"{f.path} of {self.model.where} is not a usable GGUF ({exc})") from None
                want = min(want * 2, f.size, MAX_HEADER_BYTES)
                continue
            if layout.header_size > f.size or (layout.tensors and layout.tensors[-1].offset
                                               + layout.tensors[-1].size > f.size):
                raise HubError(f"{f.path} of {self.model.where}: its header places tensors past its "
                               f"{f.size} bytes")
            if len(data) < layout.header_size:
                data += self.read(part, len(data), layout.header_size)
            return data[: layout.header_size], layout


class RangeBody:
    """A ranged request's body, read in order as its pieces come from the socket (``take``). Blocking; one thread
    at a time (``HubReader.open``)."""

    def __init__(self, reader: HubReader, part: int, start: int, end: int, response: httpx2.Response) -> None:
        self.reader, self.part, self.start, self.end = reader, part, start, end
        self.pos = start  # the file offset of the next byte to read
        self._response = response
        self._pieces = response.iter_bytes()
        self._left = memoryview(b"")

    def __enter__(self) -> RangeBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Done with it: a body not read to its end closes its connection (nothing more is read of it)."""
        self._response.close()

    def _short(self, got: int, want: int) -> HubError:
        f = self.reader.model.files[self.part]
        return HubError(f"{self.reader.model.endpoint} answered bytes {self.start}-{self.end - 1} of {f.path} with "
                        f"{got} bytes, not {want}")

    def take(self, size: int) -> Iterator[memoryview]:
        """The body's next ``size`` bytes in the pieces they come in from the socket (what runs past them is kept
        for the next call): HubError if the body ends first or breaks."""
        if not 0 <= size <= self.end - self.pos:
            raise ValueError(f"{size} bytes from {self.pos} are not within the range's end {self.end}")
        left = size
        try:
            while left:
                if not self._left:
                    piece = next(self._pieces, None)
                    if piece is None:
                        raise self._short(self.pos - self.start, self.end - self.start)
                    self._left = memoryview(piece)
                out, self._left = self._left[:left], self._left[left:]
                left -= len(out)
                self.pos += len(out)
                self.reader.read_bytes += len(out)
                yield out
        except _transport_errors() as exc:
            raise self.reader._unreadable(self.part, exc) from None

    def skip(self, size: int) -> None:
        """Read past ``size`` bytes (the alignment between two tensors' chunks)."""
        for _ in self.take(size):
            pass

    def finish(self) -> None:
        """The range read whole: HubError if the server sends more than it (one more piece is all that is read)."""
        if self.pos != self.end:
            raise ValueError(f"{self.end - self.pos} bytes of the range are unread")
        try:
            more = bool(self._left) or bool(next(self._pieces, b""))
        except _transport_errors() as exc:
            raise self.reader._unreadable(self.part, exc) from None
        if more:
            f = self.reader.model.files[self.part]
            raise HubError(f"{self.reader.model.endpoint} answered bytes {self.start}-{self.end - 1} of {f.path} "
                           f"with more bytes, not {self.end - self.start}")


def _check_parts(model: HubModel, layouts: Sequence[GGUFLayout]) -> None:
    """That the hub's files are one model: a file of its own, or every part of one set, as a set held here is
    checked (``check_set``): HubError naming the part that is not."""
    if len(layouts) == 1:
        if split_count(layouts[0]) != 1:
            raise HubError(f"{model.files[0].path} of {model.where} is a part of a "
                           f"{split_count(layouts[0])}-part set, not a model of its own")
        return
    tensors = layouts[0].metadata.get(SPLIT_TENSORS)
    try:
        if not isinstance(tensors, int) or isinstance(tensors, bool):
            raise SplitError(f"{model.files[0].path} is a part of a split set without a usable {SPLIT_TENSORS}")
        check_set([f.path for f in model.files], layouts, tensors, model.name)
    except SplitError as exc:
        raise HubError(f"{model.where}: {exc}") from None


# ----- the first holder: the whole file, hashed


Progress = Callable[[int], None]


class _Hasher:
    """Fed a file's bytes in order: the whole file's sha256, and each region's (header, tensors) as a manifest
    hashes it, chunk by chunk."""

    def __init__(self, regions: list[tuple[str | None, int, int]], chunk_size: int,
                 beside: ThreadPoolExecutor) -> None:
        self.whole = hashlib.sha256()
        # the whole file's hash runs in a thread beside the regions' (hashlib lets the GIL go): with all three
        # hashes of every byte in one thread the whole read of tools/bench_hub.py's set took 284-315 MB/s from
        # the fake hub here, 423-441 this way (load 3-4)
        self.beside = beside
        self.regions = regions
        self.chunk_size = chunk_size
        self.pos = 0
        self.at = 0  # the region being hashed
        self.region_hash = hashlib.sha256()
        self.piece = hashlib.sha256()
        self.pieces: list[bytes] = []
        self.done: list[tuple[str | None, int, int, bytes, tuple[bytes, ...]]] = []

    def feed(self, data: bytes) -> None:
        whole = self.beside.submit(self.whole.update, data)
        try:
            self._regions(data)
        finally:
            whole.result()

    def _regions(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.at >= len(self.regions):
                self.pos += len(view)
                return
            name, offset, size = self.regions[self.at]
            if self.pos < offset:
                step = min(len(view), offset - self.pos)
                view, self.pos = view[step:], self.pos + step
                continue
            into = self.pos - offset
            step = min(len(view), size - into, self.chunk_size - into % self.chunk_size)
            self.region_hash.update(view[:step])
            self.piece.update(view[:step])
            view, self.pos = view[step:], self.pos + step
            into += step
            if into % self.chunk_size == 0 or into == size:
                self.pieces.append(self.piece.digest())
                self.piece = hashlib.sha256()
            if into == size:
                hashes = tuple(self.pieces) if len(self.pieces) > 1 else ()
                self.done.append((name, offset, size, self.region_hash.digest(), hashes))
                self.region_hash, self.pieces = hashlib.sha256(), []
                self.at += 1


def _blocks(reader: HubReader, part: int) -> Iterator[bytes]:
    """File ``part``'s bytes in order, a block read ahead while the last is hashed (the read waits on the
    network, the hash on a core: in turn they took 0.54 of the server's rate here)."""
    size = reader.model.files[part].size
    ranges = [(start, min(size, start + _PASS_READ)) for start in range(0, size, _PASS_READ)]
    with ThreadPoolExecutor(1) as ahead:
        pending = ahead.submit(reader.read, part, *ranges[0])
        for following in [*ranges[1:], None]:
            data = pending.result()
            if following is not None:
                pending = ahead.submit(reader.read, part, *following)
            yield data


def hash_model(reader: HubReader, chunk_size: int = CHUNK_SIZE, progress: Progress | None = None,
               sink: Callable[[int, int, bytes], None] | None = None) -> Manifest:
    """Read every file of the hub model once, check each against the sha256 its commit pins, and build its
    manifest (the one a local copy of the same files has: the same model id).

    ``sink(part, offset, data)`` is given the bytes as they come (a whole pull writes them). HubError if a
    file's bytes are not the pinned ones."""
    tick: Progress = progress or (lambda n: None)
    model = reader.model
    reader.check()
    headers = [reader.header(i) for i in range(len(model.files))]
    _check_parts(model, [layout for _, layout in headers])
    parts, tensors = [], []
    for i, (f, (_, layout)) in enumerate(zip(model.files, headers, strict=True)):
        regions: list[tuple[str | None, int, int]] = [(None, 0, layout.header_size)]
        regions += [(t.name, t.offset, t.size) for t in layout.tensors]
        with ThreadPoolExecutor(1) as beside:
            hasher = _Hasher(regions, chunk_size, beside)
            for block in _blocks(reader, i):
                hasher.feed(block)
                if sink is not None:
                    sink(i, hasher.pos - len(block), block)
                tick(len(block))
        if hasher.whole.hexdigest() != f.sha256:
            raise HubError(f"the bytes {model.endpoint} serves as {f.path} do not hash to the sha256 "
                           f"{f.sha256[:12]} that commit {model.commit[:12]} pins (a lying mirror)")
        (_, _, header_size, header_sha, header_chunks), *rest = hasher.done
        parts.append(Part(f.size, header_size, header_sha, header_chunks))
        tensors += [TensorEntry(name or "", offset, size, digest, hashes, i) for name, offset, size, digest, hashes
                    in rest]
    first = parts[0]
    try:
        return Manifest(first.file_size, first.header_size, first.header_sha256, tuple(tensors), chunk_size,
                        first.header_chunks, tuple(parts[1:]))
    except ManifestError as exc:
        raise HubError(f"{model.name} of {model.where} has no usable manifest: {exc}") from None


def check_binding(reader: HubReader, manifest: Manifest) -> None:
    """That ``manifest`` (a member's word) describes the hub model: as many files, of the sizes the commit pins,
    each header the bytes the hub serves (read here). HubError otherwise. The tensors' hashes are checked as
    their bytes come (``fetch_from_hub``)."""
    model = reader.model
    if len(manifest.parts) != len(model.files):
        raise HubError(f"the manifest has {len(manifest.parts)} parts where {model.where} has {len(model.files)}")
    for i, (part, f) in enumerate(zip(manifest.parts, model.files, strict=True)):
        if part.file_size != f.size:
            raise HubError(f"the manifest says {f.path} is {part.file_size} bytes; commit {model.commit[:12]} "
                           f"says {f.size}")
        # exactly the header the manifest names: a volunteer reads nothing of the hub but headers and its tensors
        header = reader.read(i, 0, part.header_size)
        if hashlib.sha256(header).digest() != part.header_sha256:
            raise HubError(f"the header of {f.path} the hub serves is not the one the manifest names")


# ----- a volunteer: its own chunks


def _runs(chunks: Sequence[Chunk]) -> list[list[Chunk]]:
    """``chunks`` in runs a request each: those that follow one another in the manifest and in a file (but for at
    most _GAP_BYTES between, the alignment between tensors: never a chunk held already), spanning at most
    _RUN_BYTES (one chunk at least)."""
    runs: list[list[Chunk]] = []
    for chunk in chunks:
        if runs:
            run, last = runs[-1], runs[-1][-1]
            gap = chunk.part_offset - (last.part_offset + last.size)
            if chunk.index == last.index + 1 and chunk.part == last.part and 0 <= gap <= _GAP_BYTES and \
                    chunk.part_offset + chunk.size - run[0].part_offset <= _RUN_BYTES:
                run.append(chunk)
                continue
        runs.append([chunk])
    return runs


class _Stop:
    """Keeps the threads of a fetch that has returned from writing: one it gave up on (past its chunk's
    deadline, or cancelled) may still be reading, and the sparse file's descriptors may since be closed and
    another file's. A thread writes holding the lock, and only while the fetch goes on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True


class _Run:
    """One run of chunks: one request, read a chunk at a time (``store_next``, in whichever worker thread trio
    gives). Each piece is hashed and written at its offset as it comes, while it is in the cache (a chunk
    gathered in a buffer first, then hashed and written, read it from memory twice more: the client took 2.1-2.6
    ns of CPU a byte that way, 2.0-2.3 this one); a chunk is recorded only once its hash matches, as a member's
    pieces are (``SparseFile.write_piece``), and what was written of one that does not is freed."""

    def __init__(self, reader: HubReader, target: SparseFile, chunks: list[Chunk], stop: _Stop) -> None:
        self.reader, self.target, self.chunks, self.stop = reader, target, chunks, stop
        self._body: RangeBody | None = None
        # a thread given up on may still be reading when the worker is done with the run: it closes the body
        self._lock = threading.Lock()
        self._busy = self._closed = False

    def store_next(self, chunk: Chunk) -> None:
        """Read ``chunk`` (the run's next) and write it: BadChunk if its bytes do not match the manifest (what
        was written of them freed), HubError if the server sends anything but the run's range."""
        with self._lock:
            if self._closed:
                raise HubError("the fetch has stopped")
            self._busy = True
        try:
            if self._body is None:
                first, last = self.chunks[0], self.chunks[-1]
                self._body = self.reader.open(first.part, first.part_offset, last.part_offset + last.size)
            self._body.skip(chunk.part_offset - self._body.pos)
            digest, at = hashlib.sha256(), 0
            for piece in self._body.take(chunk.size):
                # hashlib and pwrite let the GIL go: the workers' pieces are hashed and written at once
                digest.update(piece)
                self._write(chunk, at, piece)
                at += len(piece)
            if chunk is self.chunks[-1]:
                self._body.finish()
            if digest.digest() != chunk.sha256:
                with self.stop.lock:
                    if not self.stop.stopped:
                        self.target.discard(chunk)
                raise BadChunk(f"bytes at {chunk.offset} do not match chunk {chunk.index} of the manifest")
        finally:
            with self._lock:
                self._busy, closed = False, self._closed
            if closed:
                self._close_body()

    def _write(self, chunk: Chunk, at: int, piece: memoryview) -> None:
        with self.stop.lock:
            if self.stop.stopped:
                raise HubError("the fetch has stopped")
            self.target.write_piece(chunk, at, piece)

    def close(self) -> None:
        with self._lock:
            self._closed, busy = True, self._busy
        if not busy:
            self._close_body()

    def _close_body(self) -> None:
        if self._body is not None:
            self._body.close()


async def fetch_from_hub(reader: HubReader, target: SparseFile, chunks: Sequence[Chunk], *,
                         progress: Callable[[FetchProgress], None] | None = None,
                         concurrency: int = HUB_CONCURRENCY, first_byte: float = 30.0,
                         min_rate: float = MIN_RATE) -> FetchReport:
    """Fetch the chunks ``target`` lacks from the hub, each verified against the manifest before it is
    written and recorded (served, journalled): runs of adjacent chunks a request each, a few requests at once.
    FetchFailed, naming the first chunk, when the hub's bytes do not match the manifest (a lying mirror, or a
    lying manifest), it cannot be read, or it does not deliver a chunk within ``first_byte`` seconds plus its
    size at ``min_rate`` of the last (a server dribbling bytes keeps a read's own timeout from ever firing: the
    deadline is the chunk's, as for members)."""
    key = f"hub {reader.model.endpoint}"
    missing = target.missing(chunks)
    total = sum(c.size for c in chunks)
    report = FetchReport(chunks=len(chunks), reused_bytes=total - sum(c.size for c in missing))
    queue = iter(_runs(missing))
    stop = _Stop()
    # chunks being written and not yet recorded: what a fetch that fails leaves of them is freed
    unrecorded: set[Chunk] = set()
    failures: list[str] = []
    started = trio.current_time()

    async def worker() -> None:
        for chunks in queue:
            run = _Run(reader, target, chunks, stop)
            try:
                for chunk in chunks:
                    if failures:
                        return
                    deadline = first_byte + chunk.size / min_rate
                    unrecorded.add(chunk)
                    with trio.fail_after(deadline):
                        # abandoned on the deadline: its thread ends at the read's own timeout, writing nothing
                        # once the fetch has returned
                        await trio.to_thread.run_sync(run.store_next, chunk, abandon_on_cancel=True)
                    target.record(chunk)
                    unrecorded.discard(chunk)
                    report.fetched_chunks += 1
                    report.fetched_bytes += chunk.size
                    report.by_source[key] = report.by_source.get(key, 0) + chunk.size
                    if progress is not None:
                        elapsed = max(trio.current_time() - started, 1e-9)
                        done = report.reused_bytes + report.fetched_bytes
                        rate = report.fetched_bytes / elapsed
                        progress(FetchProgress(total, done, report.fetched_bytes, rate,
                                               (total - done) / rate if rate > 0 else None, 1))
            except BadChunk:
                failures.append(f"the bytes {reader.model.endpoint} serves at {chunk.part_offset} of "
                                f"{reader.model.files[chunk.part].path} do not match the manifest (chunk "
                                f"{chunk.index}): a lying mirror, or a manifest not of {reader.model.where}")
                return
            except HubError as exc:
                failures.append(str(exc))
                return
            except trio.TooSlowError:
                failures.append(f"{reader.model.endpoint} did not deliver {chunk.size} bytes of "
                                f"{reader.model.files[chunk.part].path} within {deadline:.0f} s")
                return
            finally:
                run.close()

    def finish() -> None:
        stop.stop()
        for chunk in unrecorded:
            target.discard(chunk)
        target.flush()

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(max(1, concurrency)):
                nursery.start_soon(worker)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(finish)
    if failures:
        report.excluded[key] = failures[0]
        raise FetchFailed(failures[0], report)
    return report


# ----- the manifest of a hub model, kept


def _cache_path(state_dir: Path, model: HubModel) -> Path:
    key = hashlib.sha256("\0".join([model.repo, model.commit, *(f.sha256 for f in model.files)]).encode()).hexdigest()
    return state_dir / "hub" / f"{key[:32]}{CACHE_SUFFIX}"


def cached_manifest(state_dir: Path, model: HubModel) -> Manifest | None:
    """The manifest this node built of ``model`` before (its own hash pass), if it kept one."""
    try:
        with open(_cache_path(state_dir, model), "rb") as f:
            return Manifest.decode(f.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, ManifestError):
        return None


def remember_manifest(state_dir: Path, model: HubModel, manifest: Manifest) -> None:
    path = _cache_path(state_dir, model)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.write_bytes(manifest.encoded)
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot keep the manifest of %s in %s: %s", model.name, path.parent, exc)
