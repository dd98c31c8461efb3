"""Hugging Face as a source: ``hf:`` model specs, their resolution to one commit, and byte ranges read
from the hub (or the mirror ``HF_ENDPOINT`` names) with HTTP ``Range``, each one checked.

::

    model = resolve(parse_spec("hf:org/repo:Q4_K_M"))      # the commit, each file's size and LFS sha256
    hub = HubReader(model)
    hub.check()                                            # the server serves that commit (a stale mirror fails)
    manifest = hash_model(hub)                             # the first holder: the whole file, checked (hub_hash)
    report = await fetch_from_hub(hub, sparse, chunks)     # a volunteer: its own chunks, checked (hub_chunks)

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from meshd.store.gguf_header import GGUFError, GGUFLayout, read_layout
from meshd.store.manifest import CACHE_SUFFIX, Manifest, ManifestError
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
# Of an error's body, what is read for its message (the hub's are a line of JSON).
_ERROR_BODY = 64 << 10
# Bytes the library's HTTP/1.1 connection asks of its socket a read (httpcore2's READ_NUM_BYTES, 64 KiB, for
# which it has no setting). Each read is a piece that its parser copies four times with the interpreter lock
# held and that goes through its generators and ours (hashed, written) at a cost of its own: with three
# volunteers fetching their ranges of tools/bench_hub.py's model from the fake hub here at once, 256 KiB took
# 1.94-2.22 ns of their CPU a byte where 64 KiB took 2.11-2.35 (four runs side by side, load 5-7); 1 MiB took
# 2.19-2.21 (its copies no longer fit a core's cache). bench_hub's three ranges together (this and the journal
# flushed as a fetch goes, hub_chunks) went from 468-577 MB/s to 629-718 (four runs each, side by side, load
# 1.7-5.8; its raw reader on four connections, the same client, from 717-877 to 933-1074). A read's buffer, per
# connection, is this much at most.
_READ_BYTES = 256 << 10


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


def _session() -> httpx2.Client:
    """The library's HTTP session, its connections reading _READ_BYTES at a time."""
    import httpcore2
    from huggingface_hub import get_session

    httpcore2.HTTP11Connection.READ_NUM_BYTES = _READ_BYTES
    session: httpx2.Client = get_session()
    return session


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
        from huggingface_hub import hf_raise_for_status

        f = self.model.files[part]
        if not 0 <= start < end <= f.size:
            raise ValueError(f"bytes {start}-{end} are not within {f.path}")
        try:
            session = _session()
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


def check_parts(model: HubModel, layouts: Sequence[GGUFLayout]) -> None:
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
