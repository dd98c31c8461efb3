"""A fake hub for tests and benchmarks: a real HTTP server on loopback speaking the paths ``huggingface_hub`` calls.

Point ``HF_ENDPOINT`` at ``FakeHub.endpoint`` and the library resolves, reads
metadata and reads byte ranges from it:

* ``GET /api/models/ORG/REPO[/revision/REV]`` (``HfApi.model_info``): the commit
  a revision is at and each file's size and LFS sha256 (``blobs=true``);
* ``HEAD|GET /ORG/REPO/resolve/REV/PATH`` (``get_hf_file_metadata``, ranged
  reads): ``X-Repo-Commit``, ``X-Linked-Etag``, ``X-Linked-Size``, one
  ``Range`` a request (206 and ``Content-Range``);
* errors as the hub sends them: 404 with ``X-Error-Code`` (``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``), 401 for a private repo asked without its
  token (``private``).

Files are served from disk (``os.pread``), so a benchmark's GB-sized set costs
no memory. Every body byte sent is counted per client token (the
``Authorization`` header each volunteer's ``HF_TOKEN`` makes) and recorded as
``(token, path, start, end)``, so a test can say exactly which bytes each
volunteer read. Hostile modes, each a mirror gone wrong: ``lie`` flips a byte
of what it serves of one file, ``stale_commit`` answers every revision with an
older commit's files and headers, ``stall`` holds each body back, ``oversize`` sends more than
each range asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass
class Commit:
    sha: str
    # repo path -> (file on disk, its sha256)
    files: dict[str, tuple[Path, str]]


@dataclass
class Repo:
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    def at(self, revision: str) -> Commit | None:
        return self.commits.get(self.refs.get(revision, revision))


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        # (token, path, start, end) of every body sent
        self.reads: list[tuple[str, str, int, int]] = []
        # a mirror gone wrong: flip the byte at this offset of this path, or serve this commit for every revision
        self.lie: tuple[str, int] | None = None
        self.stale_commit: str | None = None
        # a server that holds each ranged body back this many seconds (a stall)
        self.stall = 0.0
        # a server that sends this many bytes more than each range asked (its Content-Length says so too)
        self.oversize = 0
        # private repos: the token each needs (asked without it, the hub answers as for no repo)
        self.private: dict[str, str] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def publish(self, repo: str, files: dict[str, Path], branch: str = "main") -> str:
        """A commit of ``files`` (repo path -> file on disk) on ``branch``; returns its sha."""
        digests = {p: (f, file_sha256(f)) for p, f in files.items()}
        sha = hashlib.sha1(json.dumps(sorted((p, d) for p, (_, d) in digests.items())).encode()
                           + repo.encode()).hexdigest()
        r = self.repos.setdefault(repo, Repo())
        r.commits[sha] = Commit(sha, digests)
        r.refs[branch] = sha
        return sha

    def bytes_read(self, token: str | None = None) -> int:
        with self.lock:
            return sum(end - start for t, _, start, end in self.reads if token is None or t == token)

    def ranges(self, token: str) -> list[tuple[str, int, int]]:
        with self.lock:
            return [(p, s, e) for t, p, s, e in self.reads if t == token]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _error(self, status: int, code: str) -> None:
                body = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _hidden(self, repo: str) -> bool:
                """A repo not there, or private and asked without its token (401, as the hub answers)."""
                wanted = hub.private.get(repo)
                if repo in hub.repos and (wanted is None or self.headers.get("Authorization") == f"Bearer {wanted}"):
                    return False
                self._error(401 if repo in hub.repos else 404, "RepoNotFound")
                return True

            def _commit(self, repo: str, revision: str) -> Commit | None:
                r = hub.repos[repo]
                if hub.stale_commit is not None:
                    return r.commits[hub.stale_commit]
                return r.at(revision)

            def do_GET(self) -> None:
                path = unquote(urlparse(self.path).path)
                api = re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?$", path)
                if api:
                    return self._info(api[1], api[2] or "main")
                resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if resolve:
                    return self._file(resolve[1], resolve[2], resolve[3])
                self._error(404, "EntryNotFound")

            do_HEAD = do_GET

            def _info(self, repo: str, revision: str) -> None:
                if self._hidden(repo):
                    return
                commit = self._commit(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound")
                siblings = [{"rfilename": p, "size": f.stat().st_size, "blobId": d[:40],
                             "lfs": {"sha256": d, "size": f.stat().st_size, "pointerSize": 134}}
                            for p, (f, d) in sorted(commit.files.items())]
                body = json.dumps({"id": repo, "modelId": repo, "sha": commit.sha, "private": False,
                                   "siblings": siblings}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _file(self, repo: str, revision: str, name: str) -> None:
                if self._hidden(repo):
                    return
                commit = self._commit(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound")
                if name not in commit.files:
                    return self._error(404, "EntryNotFound")
                file, digest = commit.files[name]
                size = file.stat().st_size
                start, end = 0, size
                wanted = self.headers.get("Range")
                if wanted is not None:
                    found = _RANGE.match(wanted)
                    if not found or int(found[1]) >= size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start = int(found[1])
                    end = min(size, int(found[2]) + 1) if found[2] else size
                self.send_response(206 if wanted is not None else 200)
                self.send_header("X-Repo-Commit", commit.sha)
                self.send_header("X-Linked-Etag", f'"{digest}"')
                self.send_header("ETag", f'"{digest}"')
                self.send_header("X-Linked-Size", str(size))
                self.send_header("Accept-Ranges", "bytes")
                if wanted is not None:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.send_header("Content-Length", str(end - start + (hub.oversize if wanted else 0)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if hub.stall:
                    time.sleep(hub.stall)
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                with hub.lock:
                    hub.reads.append((token, name, start, end))
                fd = os.open(file, os.O_RDONLY)
                try:
                    pos = start
                    while pos < end:
                        block = os.pread(fd, min(1 << 20, end - pos), pos)
                        if hub.lie is not None and hub.lie[0] == name and pos <= hub.lie[1] < pos + len(block):
                            at = hub.lie[1] - pos
                            block = block[:at] + bytes([block[at] ^ 0xFF]) + block[at + 1:]
                        self.wfile.write(block)
                        pos += len(block)
                    if wanted is not None:
                        for at in range(0, hub.oversize, 1 << 20):
                            self.wfile.write(bytes(min(1 << 20, hub.oversize - at)))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client that stopped reading (one cut off what it did not ask for)
                finally:
                    os.close(fd)

        return Handler
