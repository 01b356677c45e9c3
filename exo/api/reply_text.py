"""From a request's token events to the text of its reply chunks: incremental decoding and stop strings."""
from typing import Callable, Iterable, List, Optional, Sequence


class IncrementalDecoder:
  """Decodes a growing token list into new text only, never splitting a character.

  Each step decodes a small window (the tokens since the last emission plus one before them) and takes the text
  past the window's known prefix, so tokenizers that drop a leading space at the start of a decode (SentencePiece)
  keep their spaces, and a multi-byte character split across tokens waits for its last byte."""

  def __init__(self, decode: Callable[[Sequence[int]], str]):
    self.decode = decode
    self.tokens: List[int] = []
    self.prefix_start = 0  # window start: one token of context before the unread tokens
    self.read_end = 0  # tokens before this index have been emitted as text

  def push(self, tokens: Iterable[int]) -> str:
    self.tokens += [int(t) for t in tokens]
    if len(self.tokens) == self.read_end:
      return ""
    known = self.decode(self.tokens[self.prefix_start:self.read_end]) if self.read_end > self.prefix_start else ""
    text = self.decode(self.tokens[self.prefix_start:])
    if len(text) <= len(known) or text.endswith("\ufffd"):
      return ""  # nothing new yet, or the tail is an incomplete character
    self.prefix_start, self.read_end = self.read_end, len(self.tokens)
    return text[len(known):]

  def flush(self) -> str:
    """Whatever is still held back (an incomplete character shows as U+FFFD)."""
    if len(self.tokens) == self.read_end:
      return ""
    known = self.decode(self.tokens[self.prefix_start:self.read_end]) if self.read_end > self.prefix_start else ""
    text = self.decode(self.tokens[self.prefix_start:])
    self.prefix_start, self.read_end = self.read_end, len(self.tokens)
    return text[len(known):] if text.startswith(known) else text


def marker_tail(text: str, markers: Sequence[str]) -> int:
  """The length of the longest tail of `text` that is a proper prefix of one of `markers`: text that may yet become
  one, held back until the next piece shows whether it does."""
  return max((k for m in markers for k in range(1, min(len(m), len(text) + 1)) if text.endswith(m[:k])), default=0)


class StopMatcher:
  """Cuts a text stream before the first stop string. Text that might be the start of a stop string is held back
  until the next piece shows whether it is one, so nothing after a stop string is ever released."""

  def __init__(self, stop: Sequence[str]):
    self.stop = [s for s in stop if s]
    self.pending = ""
    self.matched = False
    self.matched_string: Optional[str] = None  # the stop string that matched (the earliest in the text)

  def push(self, text: str) -> str:
    if self.matched:
      return ""
    self.pending += text
    if not self.stop:
      out, self.pending = self.pending, ""
      return out
    hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stop) if i >= 0]
    if hits:
      at, self.matched_string = min(hits)
      self.matched = True
      out, self.pending = self.pending[:at], ""
      return out
    keep = marker_tail(self.pending, self.stop)
    out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
    return out

  def flush(self) -> str:
    out, self.pending = ("" if self.matched else self.pending), ""
    return out


class ReplyText:
  """One request's reply: feed it each token event, get the chunk texts to send.

  Normally one chunk per event. The reply is the model's text only: an end token (EOS, end of turn) that ends it
  adds no text, but counts as a token (usage, logprobs). When the reply ends, the last chunk carries the last
  token's text, if any, with `finish_reason` set; text held back before it goes in a chunk of its own. A stop string
  ends the reply with an empty "stop" chunk after the text before it.

  finish_reason: "stop" for an end token, a stop string, or a grammar the answer has completed (`complete(tokens)`,
  for requests whose answer follows one); "length" otherwise (the token budget or the context ran out)."""

  def __init__(self, decode: Callable[..., str], eos_token_ids: Iterable[int], stop: Sequence[str] = (),
               complete: Optional[Callable[[Sequence[int]], bool]] = None):
    self.decode = decode
    self.decoder = IncrementalDecoder(decode)
    self.matcher = StopMatcher(stop)
    self.eos_token_ids = set(eos_token_ids)
    self.complete = complete
    self.tokens: List[int] = []
    self.text = ""
    self.finish_reason: Optional[str] = None

  def feed(self, tokens: Sequence[int], is_finished: bool) -> List[str]:
    tokens = [int(t) for t in tokens]
    self.tokens += tokens
    if not is_finished:
      text = self.matcher.push(self.decoder.push(tokens))
      return self._end(text) if self.matcher.matched else self._emit([text])
    head = self.matcher.push(self.decoder.push(tokens[:-1]))
    if self.matcher.matched:
      return self._end(head)
    ends_turn = bool(tokens) and tokens[-1] in self.eos_token_ids
    # An end token's text is a special token's (none), unless the tokenizer has no special tokens at all (the dummy's).
    last_text = (self.decoder.flush() + self.decode(tokens[-1:], skip_special_tokens=True)) if ends_turn else (self.decoder.push(tokens[-1:]) + self.decoder.flush())
    whole = head + self.matcher.push(last_text)
    if self.matcher.matched:
      return self._end(whole)
    whole += self.matcher.flush()
    self.finish_reason = "stop" if ends_turn or (self.complete is not None and self.complete(self.tokens)) else "length"
    if last_text and len(whole) > len(last_text) and whole.endswith(last_text):
      return self._emit([whole[:-len(last_text)], last_text])
    return self._emit([whole])

  def _end(self, text: str) -> List[str]:
    """A stop string matched: the text before it, then an empty final chunk."""
    self.finish_reason = "stop"
    return self._emit([text, ""] if text else [""])

  def _emit(self, chunks: List[str]) -> List[str]:
    self.text += "".join(chunks)
    return chunks
