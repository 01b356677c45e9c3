"""A loopback TCP relay that delays every byte by a fixed one-way time, standing in for the link between two
machines (this kernel has no netem). Each `listen:target` pair accepts connections on `listen` and forwards them
to `target`, both directions delayed.

  python bench/relay.py --delay-ms 1 41001:40001 41002:40002

It prints "ready" once every port listens, and runs until terminated or its stdin closes."""
import argparse
import asyncio
import os
import sys
import threading
import time
from typing import List, Tuple


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
  """Copy reader to writer, each chunk written `delay_s` after it was read; order is kept."""
  queue: asyncio.Queue = asyncio.Queue()

  async def deliver():
    while True:
      due, data = await queue.get()
      if data is None:
        break
      wait = due - time.monotonic()
      if wait > 0:
        await asyncio.sleep(wait)
      writer.write(data)
      await writer.drain()

  delivering = asyncio.create_task(deliver())
  try:
    while data := await reader.read(1 << 16):
      queue.put_nowait((time.monotonic() + delay_s, data))
  except (ConnectionError, OSError):
    pass
  finally:
    queue.put_nowait((0.0, None))
    try:
      await delivering
    except (ConnectionError, OSError):
      pass
    writer.close()


async def relay(listen: int, target: int, delay_s: float) -> asyncio.AbstractServer:
  async def connected(client_reader, client_writer):
    try:
      server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
      client_writer.close()
      return
    await asyncio.gather(pump(client_reader, server_writer, delay_s), pump(server_reader, client_writer, delay_s))
  return await asyncio.start_server(connected, "127.0.0.1", listen)


async def main(pairs: List[Tuple[int, int]], delay_s: float) -> None:
  servers = [await relay(listen, target, delay_s) for listen, target in pairs]
  print("ready", flush=True)
  await asyncio.gather(*[server.serve_forever() for server in servers])


def exit_when_stdin_closes() -> None:
  """The bench that started the relay holds its stdin: once that closes (the bench has gone), so does the relay."""
  sys.stdin.read()
  os._exit(0)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay added to every byte")
  parser.add_argument("pairs", nargs="+", help="listen:target port pairs on 127.0.0.1")
  args = parser.parse_args()
  threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
  try:
    asyncio.run(main([tuple(int(p) for p in pair.split(":")) for pair in args.pairs], args.delay_ms / 1000))
  except KeyboardInterrupt:
    sys.exit(0)
