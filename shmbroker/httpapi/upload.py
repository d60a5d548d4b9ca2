"""A file upload (`POST /v1/files`, multipart/form-data) streamed to disk as it arrives.

python-multipart's push parser is fed the body chunk by chunk; the `file` part's bytes go straight
to the upload's temporary file (`files.FileStore.begin_upload`), so memory holds one chunk whatever
the file's size. Bytes and lines are counted as they pass: past `max_file_bytes` or
`max_file_lines` the upload is refused (413) at once. Each line is read as it passes, for what a
batch checks (`Lines`). A client that sends nothing for
`upload_idle_seconds` is dropped (408). Whatever ends an upload early removes its temporary file:
a torn upload leaves no file.
"""

from __future__ import annotations

import asyncio
import json
import os

from .objects import ApiError

FIELD_BYTES_MAX = 1024  # a form field other than the file (`purpose`)
LINE_BYTES_MAX = 1 << 20  # a longer line is not read as a request while it passes (the submitter reads it)
DUPLICATES_KEPT = 100


class Lines:
    """What a batch needs to know of its file, read as it passes: its lines (`number`), each line's
    `url` (the first line naming each) and the custom_ids given twice. A batch is then checked against this summary at
    once (`runner.validate`), not by reading the file again."""

    def __init__(self):
        self.number = 0
        self.urls: dict[str, int] = {}
        self.duplicates: list[tuple[int, str]] = []
        self._ids: set[str] = set()
        self._carry = bytearray()
        self._skipping = False

    def feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                if not self._skipping:
                    self._carry += chunk[start:]
                    if len(self._carry) > LINE_BYTES_MAX:
                        self._carry, self._skipping = bytearray(), True
                return
            if self._skipping:
                self._skipping = False
                self.number += 1
            else:
                self._line(bytes(self._carry) + chunk[start:end] if self._carry else chunk[start:end])
                self._carry = bytearray()
            start = end + 1

    def finish(self) -> None:
        """The last line, when the file does not end in a newline."""
        if self._skipping:
            self.number += 1
        elif self._carry:
            self._line(bytes(self._carry))
        self._carry, self._skipping = bytearray(), False

    def _line(self, line: bytes) -> None:
        self.number += 1
        try:
            row = json.loads(line)
        except ValueError:
            return
        if not isinstance(row, dict):
            return
        url, cid = row.get("url"), row.get("custom_id")
        if isinstance(url, str):
            self.urls.setdefault(url, self.number)
        if isinstance(cid, str):
            if cid in self._ids:
                if len(self.duplicates) < DUPLICATES_KEPT:
                    self.duplicates.append((self.number, cid))
            else:
                self._ids.add(cid)

    def summary(self) -> dict:
        return {"urls": self.urls, "duplicates": self.duplicates}


class Parts:
    """The parser's callbacks: the file part's bytes to `fd`, small fields kept, limits counted."""

    def __init__(self, fd: int, max_bytes: int, max_lines: int):
        self.fd, self.max_bytes, self.max_lines = fd, max_bytes, max_lines
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self._header = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._is_file = False
        self._value = bytearray()
        self.requests = Lines()

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._field, "on_header_value": self._hvalue,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
                "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self):
        self._headers, self._header, self._value = {}, b"", bytearray()

    def _field(self, data, start, end):
        self._header += data[start:end]

    def _hvalue(self, data, start, end):
        self._headers[self._header.lower()] = self._headers.get(self._header.lower(), b"") + data[start:end]

    def _header_end(self):
        self._header = b""

    def _headers_done(self):
        from python_multipart.multipart import parse_options_header

        _, opts = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = opts.get(b"name", b"").decode("utf-8", "replace")
        self._is_file = self._name == "file"
        if self._is_file:
            if self.filename is not None:
                raise ApiError(400, "the form holds more than one 'file'", param="file")
            self.filename = opts.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")[:255]

    def _data(self, data, start, end):
        chunk = data[start:end]
        if not self._is_file:
            self._value += chunk
            if len(self._value) > FIELD_BYTES_MAX:
                raise ApiError(400, f"form field {self._name!r} is over {FIELD_BYTES_MAX} bytes", param=self._name)
            return
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise ApiError(413, f"the file is over {self.max_bytes} bytes", param="file")
        self.requests.feed(chunk)  # counts the lines too
        if self.requests.number > self.max_lines:
            raise ApiError(413, f"the file has over {self.max_lines} lines", param="file")
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.fd, view):]

    def _end(self):
        if not self._is_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


async def receive_file(request, fd: int, max_bytes: int, max_lines: int, idle_seconds: float) -> Parts:
    """Stream the request's multipart body: the file part into `fd`; ApiError on anything wrong."""
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import MultipartParser, parse_options_header

    kind, opts = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or b"boundary" not in opts:
        raise ApiError(400, "an upload is multipart/form-data with a 'file' and 'purpose'")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes + (1 << 16):
        raise ApiError(413, f"the file is over {max_bytes} bytes", param="file")
    parts = Parts(fd, max_bytes, max_lines)
    parser = MultipartParser(opts[b"boundary"], parts.callbacks())
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), idle_seconds)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise ApiError(408, f"the upload sent nothing for {idle_seconds:g} s") from None
        try:
            parser.write(chunk)
        except MultipartParseError as exc:
            raise ApiError(400, f"the multipart body is malformed ({exc})") from None
    try:
        parser.finalize()
    except MultipartParseError as exc:
        raise ApiError(400, f"the multipart body is malformed ({exc})") from None
    if parts.filename is None:
        raise ApiError(400, "the form holds no 'file'", param="file")
    parts.requests.finish()
    return parts
