"""A loopback TCP relay that delays every byte by a fixed one-way time, standing in for the link between two
machines (this kernel has no netem). Each `listen:target` pair accepts connections on `listen` and forwards them
to `target`, both directions delayed.

  python bench/relay.py --delay-ms 1 41001:40001 41002:40002

It prints "ready" once every port listens, and runs until terminated or its stdin closes.

Each direction is two threads, one reading and one writing each chunk at its due time (a thread's sleep wakes within
~0.1 ms). An asyncio relay added ~0.4 ms of its own to each 1 ms (its event loop's turns and epoll's millisecond
timeouts): a gRPC call's one-way time through it was 2.0-2.2 ms against 0.6-0.7 ms direct."""
import argparse
import collections
import ctypes
import os
import socket
import sys
import threading
import time
from typing import List, Tuple

PR_SET_TIMERSLACK = 29  # prctl(2)


def precise_sleeps() -> None:
  """This thread's sleeps end when due: Linux may wake a thread up to its timer slack (50 us by default) late, to
  batch wake-ups; 1 ns asks for none (Linux only; elsewhere nothing changes). A chunk's read-to-write time for a
  1 ms delay, in a two-node pipeline's hops: 1.11 -> 1.06 ms p50."""
  try:
    ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
  except (OSError, AttributeError):
    pass


def pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
  """Copy source to sink, each chunk written `delay_s` after it was read; order is kept."""
  chunks: collections.deque = collections.deque()
  arrived = threading.Condition()

  def deliver():
    precise_sleeps()
    while True:
      with arrived:
        while not chunks:
          arrived.wait()
        due, data = chunks.popleft()
      if data is None:
        break
      wait = due - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      try:
        sink.sendall(data)
      except OSError:
        break
    try:
      sink.shutdown(socket.SHUT_WR)
    except OSError:
      pass

  threading.Thread(target=deliver, daemon=True).start()
  try:
    while data := source.recv(1 << 16):
      with arrived:
        chunks.append((time.monotonic() + delay_s, data))
        arrived.notify()
  except OSError:
    pass
  with arrived:
    chunks.append((0.0, None))
    arrived.notify()


def relay(listen: int, target: int, delay_s: float) -> socket.socket:
  server = socket.create_server(("127.0.0.1", listen))

  def accept():
    while True:
      client, _ = server.accept()
      try:
        upstream = socket.create_connection(("127.0.0.1", target))
      except OSError:
        client.close()
        continue
      for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      threading.Thread(target=pump, args=(client, upstream, delay_s), daemon=True).start()
      threading.Thread(target=pump, args=(upstream, client, delay_s), daemon=True).start()
  threading.Thread(target=accept, daemon=True).start()
  return server


def main(pairs: List[Tuple[int, int]], delay_s: float) -> None:
  for listen, target in pairs:
    relay(listen, target, delay_s)
  print("ready", flush=True)
  sys.stdin.read()  # the bench that started the relay holds its stdin: once that closes (the bench has gone), so does the relay
  os._exit(0)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay added to every byte")
  parser.add_argument("pairs", nargs="+", help="listen:target port pairs on 127.0.0.1")
  args = parser.parse_args()
  try:
    main([tuple(int(p) for p in pair.split(":")) for pair in args.pairs], args.delay_ms / 1000)
  except KeyboardInterrupt:
    sys.exit(0)
