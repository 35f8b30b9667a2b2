"""Read a big JSON trace a chunk of whole array elements at a time, never holding the document.

torch writes both of its traces pretty-printed, one array element after another at a fixed indent:

    "traceEvents": [                      "nodes": [
      {                                         {
        "ph": "X", "cat": "cpu_op", ...           "id": 2, "name": "...", ...
      },                                        },
      {                                         {

No string in JSON holds a raw newline, so `\\n<indent>},\\n<indent>{` occurs only between two elements:
the raw (gunzipped) bytes can be cut there into chunks of complete elements, each parsed on its own.
`stream_array` yields such chunks plus the document around the array; it raises `NotTorchLayout` when
the file does not look like that (minified, other writer), and the caller parses it whole instead.
Gunzipping runs on a second thread (zlib releases the GIL), so it overlaps the parsing.
"""
from __future__ import annotations

import json
import queue
import threading
import zlib
from pathlib import Path
from typing import Iterator

from advisor.errors import AdvisorError

BLOCK = 8 << 20  # bytes of JSON per chunk (kept under glibc's mmap threshold cap, so buffers get reused)
HEAD_LIMIT = 4 << 20  # the array must start within this many bytes


class NotTorchLayout(Exception):
    """The file is valid so far but not laid out the way torch writes it: parse it whole."""


def loads(raw: bytes):
    """JSON text (bytes) to Python objects, with orjson where it is installed."""
    try:
        import orjson  # optional, not a dependency: 3-5x faster than json on trace text

        return orjson.loads(raw)
    except ImportError:
        return json.loads(raw)


def read_bytes(path: Path, what: str) -> bytes:
    """The whole file, gunzipped if it is gzip (the slow path, for small or unusual files)."""
    return b"".join(raw_blocks(path, what))


def raw_blocks(path: Path, what: str, size: int | None = None) -> Iterator[bytes]:
    """The file's bytes in blocks, gunzipped on a background thread; AdvisorError for unreadable or corrupt files."""
    size = size or BLOCK
    try:
        f = open(path, "rb", buffering=0)  # unbuffered: no buffer lock for a daemon thread to hold at exit
    except OSError as e:
        raise AdvisorError(f"cannot read {what} {path}: {e.strerror}")
    with f:
        gz = f.read(2) == b"\x1f\x8b"
        f.seek(0)
        q: queue.Queue = queue.Queue(maxsize=3)
        stop = threading.Event()

        def produce():
            try:
                for b in (_gunzip(f, size) if gz else iter(lambda: f.read(size), b"")):
                    while not stop.is_set():
                        try:
                            q.put(b, timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
                q.put(b"")
            except (OSError, EOFError, zlib.error) as e:
                q.put(e)

        t = threading.Thread(target=produce, daemon=True)
        t.start()
        try:
            while True:
                b = q.get()
                if isinstance(b, Exception):
                    if gz:
                        raise AdvisorError(f"{what} {path} is a truncated or corrupt gzip file")
                    raise AdvisorError(f"cannot read {what} {path}: {b}")
                if not b:
                    return
                yield b
        finally:
            stop.set()
            t.join()


def _gunzip(f, size: int) -> Iterator[bytes]:
    """Decompress gzip members one after another (zlib releases the GIL while it inflates)."""
    d, fresh, data, at_end = zlib.decompressobj(31), True, b"", False
    while True:
        if not data and not at_end:
            data = f.read(1 << 20)
            at_end = not data
        fresh = fresh and not data
        out = d.decompress(data, size)  # at most `size` bytes; the rest of the input waits in unconsumed_tail
        data = d.unconsumed_tail
        if out:
            yield out
        if d.eof:  # a member ended; another may follow
            data, d, fresh = d.unused_data + data, zlib.decompressobj(31), True
        elif not out and not data and at_end:
            break
    if not fresh:
        raise EOFError("compressed file ended before the end-of-stream marker")


def stream_array(path: Path, what: str, key: str, indent: bytes) -> tuple[Iterator[bytes], dict]:
    """(chunks, rest): chunks of whole elements of the top-level array `key`, each `{...},\\n{...}` with
    the elements' own indentation; `rest` is filled, once the chunks are consumed, with the document's
    other top-level fields. Raises NotTorchLayout before yielding anything if the layout is not torch's."""
    blocks = raw_blocks(path, what)
    opener = b'"' + key.encode() + b'": [\n'
    head = b""
    for b in blocks:
        head += b
        if opener in head or len(head) > HEAD_LIMIT:
            break
    at = head.find(opener)
    if at < 0 or not head[at + len(opener):].startswith(indent + b"{\n") or not head.lstrip().startswith(b"{"):
        blocks.close()
        raise NotTorchLayout(what)
    body = head[at + len(opener):]
    rest: dict = {}
    return _chunks(blocks, body, head[:at + len(opener) - 2], indent, rest, path, what), rest


def _chunks(blocks, buf: bytes, head: bytes, indent: bytes, rest: dict, path: Path, what: str) -> Iterator[bytes]:
    sep = b"\n" + indent + b"},\n" + indent + b"{"
    keep = len(b"\n" + indent + b"}")
    for b in blocks:
        # Cut at the block's last separator, copying the block once: buf (the part element left over from the
        # last cut) holds no separator, so if the block has one, the last one in buf + block is the block's.
        cut = b.rfind(sep)
        if cut < 0:
            buf += b
            continue
        chunk, buf = b"".join((buf, memoryview(b)[:cut + keep])), b[cut + keep + 2:]
        yield chunk
    end = buf.rfind(b"\n" + indent + b"}\n")
    close = buf.find(b"]", end + keep + 1) if end >= 0 else -1
    if end < 0 or close < 0 or buf[end + keep:close].strip():
        raise AdvisorError(f"{what} {path} is not valid JSON (truncated?): the array never closes")
    yield buf[:end + keep]
    try:
        doc = loads(head + b"[]" + buf[close + 1:])
    except ValueError as e:
        raise AdvisorError(f"{what} {path} is not valid JSON (truncated?): {str(e).splitlines()[0][:120]}")
    if not isinstance(doc, dict):
        raise AdvisorError(f"{what} {path} is not valid JSON: the top level is not an object")
    rest.update(doc)
