"""The neuron dashboard's HTTP surface, attacked on 127.0.0.1: only ``GET /`` and ``GET /api/state`` are served.

A real :class:`~template.base.dashboard.DashboardServer` (aiohttp, its own thread) is started in the test process on
a free loopback port and spoken to with raw bytes over a socket, so that no client library cleans a request up first.
Every other method is refused (405), every other path is 404, a request body is not read, and a fuzz of paths (dot
segments, encoded slashes, names of real files next to the server) and headers (random names and values, CR/LF, huge
and contradictory lengths) never gets a file's contents, a traceback or a 500 back.
"""

from __future__ import annotations

import json
import socket
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from template.base.config import DashboardConfig
from template.base.dashboard import PAGE, DashboardError, DashboardServer, start_dashboard
from template.base.dashboard_state import DashboardState

SECRET = f"secret-{uuid.uuid4()}"
NEXT_TO_THE_SERVER = ["dashboard.html", "dashboard.py", "dashboard_state.py", "secret.txt", "__init__.py"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A validator's dashboard with one scored round; a secret file in the working directory of the test process."""
    directory = tmp_path_factory.mktemp("cwd")
    (directory / "secret.txt").write_text(SECRET)
    state = DashboardState("validator", "1.2.3")
    state.record(dict(event="scored", time=1.0, round=1, miners=[dict(uid=1, hotkey="5a", score=0.5)]))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        dashboard = DashboardServer(state, "127.0.0.1", 0).start()
        try:
            yield dashboard
        finally:
            dashboard.close()


def raw(server: DashboardServer, request: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is and read one final answer (interim ``100 Continue`` answers skipped): up to its
    Content-Length, or to the server's close; status 0 when the server closed, or went quiet, without answering."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(request)
        buffer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                chunk = b""
            buffer += chunk
            assert len(buffer) < 1 << 20, "an answer larger than any the dashboard sends"
            while buffer.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in buffer:
                buffer = buffer.partition(b"\r\n\r\n")[2]  # an interim answer: the final one follows
            answer = parse(buffer, bodyless=request.startswith(b"HEAD "))
            if answer is not None or not chunk:
                return answer or (0, {}, b"")


def parse(buffer: bytes, bodyless: bool) -> tuple[int, dict[str, str], bytes] | None:
    """A complete answer in ``buffer``, or None while it is incomplete (the answer to HEAD has no body)."""
    head, found, body = buffer.partition(b"\r\n\r\n")
    if not found:
        return None
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if not bodyless and len(body) < int(headers.get("content-length", "0")):
        return None
    return int(status_line.split()[1]), headers, body


def request(method: str, path: str, *headers: str, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def assert_harmless(status: int, body: bytes) -> None:
    assert status != 500 and status < 600, (status, body[:300])
    assert SECRET.encode() not in body
    assert b"Traceback" not in body and b'File "' not in body, body[:500]
    assert b"class DashboardServer" not in body and b"def record" not in body  # the server's own source


def test_the_page_and_the_state_are_served_with_a_strict_content_security_policy(server):
    status, headers, body = raw(server, request("GET", "/"))
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert body == PAGE.read_bytes()
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'sha256-" in policy
    assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
    status, headers, body = raw(server, request("GET", "/api/state"))
    assert status == 200 and headers["content-type"].startswith("application/json")
    document = json.loads(body)
    assert document["neuron"]["role"] == "validator" and document["miners"][0]["score"] == 0.5
    assert b"http://" not in PAGE.read_bytes().replace(b"http://www.w3.org/2000/svg", b"")  # loads nothing from outside
    assert b"https://" not in PAGE.read_bytes()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "PROPFIND"])
@pytest.mark.parametrize("path", ["/", "/api/state"])
def test_every_method_but_get_is_refused(server, method, path):
    status, headers, body = raw(server, request(method, path, "Content-Length: 5", body=b"hello"))
    assert status == 405 and headers["allow"] == "GET"
    assert_harmless(status, body)


@pytest.mark.parametrize("path", [
    "/index.html", "/api", "/api/", "/api/state/", "/api/state/x", "/dashboard.html", "/secret.txt", "/../secret.txt",
    "/%2e%2e/secret.txt", "/..%2fsecret.txt", "//secret.txt", "/template/base/dashboard.py", "/static/", "/.git/HEAD",
    "/%2fetc%2fpasswd", "/../../../../etc/passwd", "/api/../secret.txt", "/favicon.ico",
])
def test_no_other_path_is_served(server, path):
    status, _, body = raw(server, request("GET", path))
    assert status in (400, 404), (path, status)
    assert_harmless(status, body)


def test_a_request_body_is_never_read_and_a_huge_one_is_refused(server):
    status, _, body = raw(server, request("GET", "/api/state", f"Content-Length: {10 ** 9}"))
    assert_harmless(status, body)
    status, _, body = raw(server, request("GET", "/", "Transfer-Encoding: chunked", body=b"ffffffff\r\n" + b"x" * 5000))
    assert_harmless(status, body)
    status, _, body = raw(server, request("GET", "/" + "a" * 10_000))  # longer than the request line may be
    assert status in (400, 414) and len(body) < 2000
    for path in ("/", "/api/state", "/missing"):  # aiohttp's own Expect handling answered these with a 500
        for expect in ("\x80", "100-continue", "something-else"):
            status, _, body = raw(server, request("GET", path, f"Expect: {expect}"))
            assert_harmless(status, body)
            assert status == (404 if path == "/missing" else 200), (path, expect, status)


SEGMENTS = st.one_of(
    st.sampled_from(["..", ".", "%2e%2e", "%2E%2e", "%2f", "%5c", "%00", "~", "", "api", "state", "etc", "passwd",
                     "template", "base", ".git", *NEXT_TO_THE_SERVER]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"), max_size=12),
)
PATHS = st.builds(lambda parts, query: "/" + "/".join(parts) + query,
                  st.lists(SEGMENTS, max_size=6),
                  st.sampled_from(["", "?", "?file=../secret.txt", "?x=%00", "#frag"]))
HEADER_NAMES = st.one_of(st.sampled_from(["Host", "Range", "Content-Length", "Transfer-Encoding", "Accept-Encoding",
                                          "If-None-Match", "Origin", "Cookie", "X-Forwarded-For", "Expect",
                                          "Upgrade", "Content-Type"]),
                         st.from_regex(r"[A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]{0,30}", fullmatch=True))
HEADER_VALUES = st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200),
                          st.sampled_from(["-1", "99999999999999999999", "chunked", "gzip, chunked", "bytes=0-",
                                           "100-continue", "websocket", "a\r\nInjected: 1", "\x00"]),
                          st.binary(max_size=40).map(lambda b: b.decode("latin-1")))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "GET", "GET", "POST", "HEAD", "FOO", "get"]), path=PATHS,
       headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6))
def test_fuzzed_paths_and_headers_never_reach_a_file_or_a_traceback(server, method, path, headers):
    lines = [f"{name}: {value}" for name, value in headers]
    status, _, body = raw(server, request(method, path, *lines))
    assert_harmless(status, body)
    if status == 200:  # only the two documents exist
        assert body == PAGE.read_bytes() or json.loads(body)["neuron"]["role"] == "validator"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=600))
def test_garbage_instead_of_http_gets_a_plain_error(server, garbage):
    status, _, body = raw(server, garbage + b"\r\n\r\n")
    assert_harmless(status, body)
    assert status != 200 or garbage.startswith(b"GET ")


def test_a_taken_port_is_a_clear_error_and_closing_twice_is_harmless(server):
    with pytest.raises(DashboardError, match=f"cannot serve the dashboard on 127.0.0.1:{server.port}"):
        start_dashboard(DashboardConfig(port=server.port), "miner")
    other = start_dashboard(DashboardConfig(port=free_port()), "miner")
    assert raw(other, request("GET", "/api/state"))[0] == 200
    other.close()
    other.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", other.port), timeout=2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
