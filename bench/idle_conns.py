#!/usr/bin/env python3
"""bench/growth's idle keep-alive connections: opens N HTTP/1.1 connections to HOST:PORT, makes
one `GET PATH` on each (read to the end of its response, so every connection is fully set up on
both sides), and then leaves them all open and idle.

Usage: idle_conns.py HOST PORT N [PATH]
PATH `-` sends no request: the connections are opened and left silent.
Prints `OPEN n=.. ok=.. failed=.. seconds=..` once the N requests are answered, then waits for a
line on stdin (or its end), closes every connection and prints `CLOSED`. Opens at most 200
connections at a time, so that no listen queue overflows. Needs `ulimit -n` above N.
"""
import asyncio
import sys
import time


async def one(host, port, path, sem, conns, failures):
    async with sem:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            if path == "-":
                conns.append(writer)
                return
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            if status != 200:
                raise RuntimeError(f"status {status}")
            conns.append(writer)
        except Exception as e:  # noqa: BLE001 - counted and reported
            failures.append(repr(e))


async def main():
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    path = sys.argv[4] if len(sys.argv) > 4 else "/items/42"
    sem = asyncio.Semaphore(200)
    conns, failures = [], []
    t0 = time.monotonic()
    await asyncio.gather(*(one(host, port, path, sem, conns, failures) for _ in range(n)))
    print(f"OPEN n={n} ok={len(conns)} failed={len(failures)} seconds={time.monotonic() - t0:.1f}"
          + (f" first_error={failures[0]!r}" if failures else ""), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for w in conns:
        w.close()
    print("CLOSED", flush=True)


asyncio.run(main())
