"""The OpenAI endpoints' HTTP server takes a burst of clients connecting at once: its listen backlog
is far above socketserver's default of 5 (at 5, one of 16 clients connecting together was reset:
benchmarks/sun/sun_vs_multilora.py), and every endpoint serves through it."""
import inspect
import socket

from edge.api import openai_http
from edge.api.openai_http import BurstServer


def test_the_server_listens_with_a_burst_sized_backlog_and_all_connect_at_once():
    class Quiet(openai_http.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
    srv = BurstServer(("127.0.0.1", 0), Quiet)
    socks = []
    try:
        assert srv.request_queue_size >= 64 and srv.daemon_threads
        for _ in range(32):                     # nobody accepts yet: the kernel's queue holds them all
            s = socket.create_connection(srv.server_address, timeout=30)
            socks.append(s)
        assert len(socks) == 32
    finally:
        for s in socks:
            s.close()
        srv.server_close()
    assert "BurstServer((host, port), Handler)" in inspect.getsource(openai_http.OpenAIServer.__init__)
