"""A TCP proxy that delays each direction by a one-way latency with jitter: a stand-in for
`tc netem delay` on kernels without netem (this one has none).

    python -m harness.delay_proxy --listen 10.1.2.1:9883 --to 10.1.2.1:8883 --profile wifi

Every chunk read from one side is written to the other `mean +- jitter` ms later (uniform),
never before the chunk read before it (TCP is a byte stream: the delay may vary, the order
may not). The bytes pass through untouched, so TLS stays end to end. Change the delay while
it runs by writing a line to its stdin -- a profile name (`cellular`) or `MEAN_MS JITTER_MS`;
it answers `delay MEAN+-JITTER ms` on stderr once the new delay applies to the next chunk.
`corrupt` flips one byte of the next client-to-server chunk (a tampering middlebox: TLS must
refuse it); `stats` prints `stats connections=N bytes=N corrupted=N`.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
from typing import Optional

# one-way delay per direction (ms): mean, jitter (uniform +-)
PROFILES = {"none": (0.0, 0.0), "lan": (1.0, 0.3), "wifi": (5.0, 3.0), "cellular": (40.0, 15.0)}


class Delay:
    """The current one-way delay; set() may be called from another thread."""

    def __init__(self, mean_ms: float = 0.0, jitter_ms: float = 0.0, seed: int = 0) -> None:
        self.mean_ms, self.jitter_ms = mean_ms, jitter_ms
        self._rng = random.Random(seed)
        self.corrupt_next = 0              # chunks still to tamper with

    def set(self, spec: str) -> str:
        spec = spec.strip()
        if spec in PROFILES:
            mean, jitter = PROFILES[spec]
        else:
            try:
                mean, jitter = (float(x) for x in spec.split())
            except ValueError:
                raise ValueError(f"{spec!r}: write a profile ({', '.join(PROFILES)}) or 'MEAN_MS JITTER_MS'") \
                    from None
        if mean < 0 or jitter < 0:
            raise ValueError(f"{spec!r}: delays are not negative")
        self.mean_ms, self.jitter_ms = mean, jitter
        return f"delay {mean:g}+-{jitter:g} ms"

    def sample_s(self) -> float:
        m, j = self.mean_ms, self.jitter_ms
        return max(0.0, m + (self._rng.uniform(-j, j) if j else 0.0)) / 1000.0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay, stats: dict) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        last = 0.0
        try:
            while True:
                data = await reader.read(65536)
                last = max(loop.time() + delay.sample_s(), last)   # ordered: never overtake
                await queue.put((last, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            await queue.put((last, b""))

    async def write() -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                if delay.corrupt_next > 0:
                    delay.corrupt_next -= 1
                    data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x5A]) + data[len(data) // 2 + 1:]
                    stats["corrupted"] += 1
                writer.write(data)
                stats["bytes"] += len(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    await asyncio.gather(read(), write())


async def serve(listen: tuple[str, int], to: tuple[str, int], up: Delay, down: Delay,
                ready=lambda port: None, stats: Optional[dict] = None) -> None:
    stats = stats if stats is not None else {}
    stats.update(connections=0, bytes=0, corrupted=0)

    async def handle(c_reader, c_writer):
        stats["connections"] += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(*to)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(_pipe(c_reader, s_writer, up, stats), _pipe(s_reader, c_writer, down, stats))
        finally:
            for w in (c_writer, s_writer):
                w.close()

    server = await asyncio.start_server(handle, *listen)
    ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


class ProxyThread:
    """The proxy in a thread of this process (tests): `with ProxyThread(("127.0.0.1", 1883)) as p:`
    clients connect to p.port; p.set("3000 0") holds both directions' bytes 3 s (a cut shorter
    than the keepalive: TCP keeps the connection and delivers them after), p.set("none") heals."""

    def __init__(self, to: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.to, self.host = to, host
        self.up, self.down = Delay(seed=1), Delay(seed=2)
        self.stats: dict = {}
        self.port = 0

    def set(self, spec: str) -> None:
        for d in (self.up, self.down):
            d.set(spec)

    def __enter__(self) -> "ProxyThread":
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def on_ready(port):
            self.port = port
            ready.set()
        self._loop.create_task(serve((self.host, 0), self.to, self.up, self.down, on_ready, self.stats))
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the proxy did not start listening within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        async def shutdown():              # every pipe and the server, before the loop stops
            tasks = [x for x in asyncio.all_tasks() if x is not asyncio.current_task()]
            for x in tasks:
                x.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def _addr(spec: str) -> tuple[str, int]:
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: write HOST:PORT")
    return host, int(port)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", type=_addr, required=True, metavar="HOST:PORT", help="where clients connect")
    ap.add_argument("--to", type=_addr, required=True, metavar="HOST:PORT", help="the server behind it")
    ap.add_argument("--profile", default="none", help=f"start delay: {', '.join(PROFILES)} or 'MEAN JITTER' (ms)")
    ap.add_argument("--seed", type=int, default=0, help="jitter seed")
    a = ap.parse_args(argv)
    up, down = Delay(seed=a.seed), Delay(seed=a.seed + 1)
    stats: dict = {}
    try:
        for d in (up, down):
            msg = d.set(a.profile)
    except ValueError as e:
        ap.error(str(e))

    def control() -> None:                 # stdin lines change both directions' delay
        for line in sys.stdin:
            if not line.strip():
                continue
            if line.strip() in ("corrupt", "stats"):
                if line.strip() == "corrupt":
                    up.corrupt_next += 1
                print("stats " + " ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr, flush=True)
                continue
            try:
                for d in (up, down):
                    ack = d.set(line)
            except ValueError as e:
                ack = f"error: {e}"
            print(ack, file=sys.stderr, flush=True)

    threading.Thread(target=control, daemon=True).start()
    ready = lambda port: print(f"proxy on {a.listen[0]}:{port} -> {a.to[0]}:{a.to[1]}, {msg}",  # noqa: E731
                               file=sys.stderr, flush=True)
    try:
        asyncio.run(serve(a.listen, a.to, up, down, ready, stats))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
