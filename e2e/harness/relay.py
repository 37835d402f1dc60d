"""A TCP relay from the real node's address to kube-apiserver on loopback, so pods reach the API.

kube-apiserver listens on 127.0.0.1 only (nothing of the test cluster is exposed off this machine);
pods reach 10.96.0.1:443 (the `kubernetes` Service), which kube-proxy sends to the endpoint the
harness sets: this relay on the node's address. TLS passes through untouched (the apiserver's
certificate names 10.96.0.1).

    python relay.py --listen 10.244.0.1:6443 --to 127.0.0.1:PORT --tag WORKDIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


async def relay(listen: tuple[str, int], to: tuple[str, int]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*to)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, *listen)
    print(f"relay: {listen[0]}:{listen[1]} -> {to[0]}:{to[1]}", flush=True)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=_address, required=True)
    ap.add_argument("--to", type=_address, required=True)
    ap.add_argument("--tag", help="the work directory, so the harness's teardown finds this process")
    args = ap.parse_args()
    asyncio.run(relay(args.listen, args.to))


if __name__ == "__main__":
    main()
