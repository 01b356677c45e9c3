"""tinychat driven in a headless Chromium (Debian's, or the Chrome GitHub's runners ship; tests/support/browser.py)
against a real node: a streamed answer from SmolLM2, conversations kept in localStorage, both finish kinds, errors,
the topology and download views. Screenshots go to tests/artifacts/ (gitignored). (Its files as served:
test_tinychat_files.py.)"""
import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exo.api.settings import ApiSettings
from exo.download.download_progress import RepoFileProgressEvent, RepoProgressEvent
from exo.inference.shard import Shard
from tests.support.api_server import ApiServer, FailingEngine, shared_server
from tests.support.browser import find_browser

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
  sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (never `playwright install`: we drive the system's browser)")
  executable = find_browser()
  if executable is None:
    pytest.skip("needs Chromium or Google Chrome: apt-get install -y chromium (Debian), or set CHROME_BIN")
  with sync_api.sync_playwright() as p:
    context = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")), executable_path=executable, headless=True,
                                                   args=FLAGS, viewport={"width": 1280, "height": 800})
    yield context
    context.close()


@pytest.fixture
def open_page(browser):
  pages = []

  def open_(url):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.evaluate("localStorage.clear()")
    page.reload()
    page.wait_for_function("document.querySelectorAll('#model-select option').length > 0")
    pages.append((page, errors))
    return page
  yield open_
  for page, errors in pages:
    page.close()
    assert not errors, errors


def ask(page, text, timeout_s=120):
  """Send a message and wait for its answer (or error) to be complete."""
  replies = "document.querySelectorAll('.message.assistant, .message.error').length"
  before = page.evaluate(replies)
  page.fill("#prompt", text)
  page.press("#prompt", "Enter")
  page.wait_for_function(f"{replies} > {before} && !document.querySelector('.message.assistant.streaming')", timeout=timeout_s * 1000)


def histories(page):
  return json.loads(page.evaluate("localStorage.getItem('histories')") or "[]")


def test_streamed_answer_from_smollm2(open_page):
  server = shared_server("numpy")
  page = open_page(server.url)
  assert page.input_value("#model-select") == "smollm2-135m"
  # Record every text the answer bubble shows, to see it grow token by token.
  page.evaluate("""() => {
    window.seen = [];
    new MutationObserver(() => {
      const node = document.querySelector('.message.assistant');
      if (node && node.textContent !== window.seen[window.seen.length - 1]) window.seen.push(node.textContent);
    }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
  }""")
  ask(page, "What is the capital of France?")
  answer = page.inner_text(".message.assistant")
  assert "Paris" in answer and "<|im_end|>" not in answer
  seen = page.evaluate("window.seen")
  assert len([s for s in seen if s]) >= 3, seen  # it appeared piece by piece
  assert re.search(r"first token [\d.]+ s", page.inner_text("#stats"))
  saved = histories(page)
  assert len(saved) == 1 and [m["role"] for m in saved[0]["messages"]] == ["user", "assistant"]
  assert "Paris" in saved[0]["messages"][1]["content"] and saved[0]["model"] == "smollm2-135m"
  page.wait_for_selector("#node-list li")
  assert "api-test-node" in page.inner_text("#node-list") and page.locator("#topology .node").count() == 1
  ARTIFACTS.mkdir(exist_ok=True)
  page.screenshot(path=str(ARTIFACTS / "tinychat.png"))


def test_conversations_persist_and_the_stop_chunks_text_is_kept(open_page):
  server = shared_server("dummy")
  page = open_page(server.url)
  ask(page, "first question")
  # Ten tokens; the server never sends an end-of-turn marker's text (the dummy tokenizer has no special tokens, so
  # its last token reads "dummy" too), and the text of the "stop" chunk is part of the answer.
  assert page.inner_text(".message.assistant").strip() == "dummy" * 10
  page.click("#new-chat")
  ask(page, "second question")
  assert [h["title"] for h in histories(page)] == ["second question", "first question"]
  page.reload()
  page.wait_for_selector("#history-list li")
  assert page.locator("#history-list li").count() == 2
  page.click("#history-list li:nth-child(2)")
  assert page.inner_text(".message.user") == "first question"
  page.click("#history-list li:nth-child(2) .delete")
  assert [h["title"] for h in histories(page)] == ["second question"]


def test_length_finish_keeps_last_token_and_errors_show(open_page):
  short = ApiServer("dummy", max_generate_tokens=5).start()
  failing = ApiServer(FailingEngine()).start()
  try:
    page = open_page(short.url)
    ask(page, "cut me short")
    answer = page.inner_text(".message.assistant")
    assert answer.startswith("dummy" * 5) and "dummy" * 6 not in answer and "length limit" in answer
    page = open_page(failing.url)
    ask(page, "break please")
    assert "engine exploded" in page.inner_text(".message.error")
  finally:
    short.stop()
    failing.stop()


def test_download_progress_view(open_page):
  server = shared_server("dummy")
  page = open_page(server.url)
  arriving = RepoFileProgressEvent("org/some-model", "main", "w.safetensors", 100 * 2**20, 100 * 2**20, 400 * 2**20, 25 * 2**20, 12.0, "in_progress", 0.0)
  event = RepoProgressEvent(Shard("dummy", 0, 7, 8), "org/some-model", "main", 1, 3, 300 * 2**20, 300 * 2**20, 1200 * 2**20, 25 * 2**20, 36.0,
                            {"w.safetensors": arriving}, "in_progress")
  server.node.node_download_progress["peer-b"] = event
  server.node.node_download_sources["peer-b"] = {"w.safetensors": "peer peer-a"}  # where its file comes from
  try:
    page.wait_for_selector(".download", timeout=5000)
    text = page.inner_text("#downloads")
    assert "org/some-model on peer-b" in text and "300.0 MB / 1.2 GB" in text and "25.0 MB/s" in text and "36 s" in text
    assert "w.safetensors from peer peer-a · 25%" in text, text
    assert page.get_attribute(".download .bar > div", "style").rstrip(";") == "width: 25.0%"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tinychat-downloads.png"))
  finally:
    server.node.node_download_progress.clear()
    server.node.node_download_sources.clear()
  page.wait_for_selector(".download", state="detached", timeout=5000)


def test_a_node_with_an_api_key_asks_for_it_once(browser):
  server = ApiServer("dummy", settings=ApiSettings(api_key="sekrit")).start()
  page = browser.new_page()
  prompts, errors = [], []
  page.on("dialog", lambda dialog: (prompts.append(dialog.message), dialog.accept("sekrit")))
  page.on("pageerror", lambda e: errors.append(str(e)))
  try:
    page.goto(server.url)  # a fresh port: this origin's localStorage starts empty
    page.wait_for_function("document.querySelectorAll('#model-select option').length > 0")
    ask(page, "hello with a key")
    assert page.inner_text(".message.assistant").strip() == "dummy" * 10
    assert page.evaluate("localStorage.getItem('apiKey')") == "sekrit"
    page.reload()  # the kept key is sent from now on: no second question
    page.wait_for_function("document.querySelectorAll('#model-select option').length > 0")
    page.wait_for_selector("#node-list li")
    ask(page, "and again")
    assert len(prompts) == 1 and "API key" in prompts[0], prompts
    assert not errors, errors
  finally:
    page.close()
    server.stop()


def test_the_topology_view_shows_each_nodes_group_and_layers(open_page, make_server):
  server = make_server("dummy", placement="auto")
  page = open_page(server.url)
  page.wait_for_selector("#node-list .layers")
  assert "dummy: one group, layers 0–7 of 8" in page.inner_text("#node-list")  # placed, not loaded yet: "loading"
  ask(page, "hello")
  page.wait_for_function("!document.querySelector('#node-list').innerText.includes('loading')", timeout=30000)
  assert "dummy: one group, layers 0–7 of 8" in page.inner_text("#node-list")


def test_a_download_shows_a_growing_bar_and_a_failure_says_why(open_page, tmp_path):
  """A real node fetching llama-3.2-1b from a slowed stand-in hub: the bar grows as bytes arrive; then a model whose
  repository the hub lacks: the downloads view and a chat with it say so."""
  from tests.support.checkpoints import write_layer_split_llama
  from tests.support.cluster import Cluster
  from tests.support.stand_in_hub import StandInHub
  hub = StandInHub().start()
  hub.add_repo("unsloth/Llama-3.2-1B-Instruct", write_layer_split_llama(tmp_path / "llama", 16))
  hub.bytes_per_second = 2e6  # ~9 s for its ~17 MB: several of tinychat's polls (one a second)
  cluster = Cluster(tmp_path, ["chat-node"], "numpy", {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""})
  try:
    with ThreadPoolExecutor(1) as thread:  # playwright's sync API holds this thread's event loop
      thread.submit(asyncio.run, cluster.start()).result()
    page = open_page(cluster.url("chat-node"))
    page.evaluate("""() => {
      window.widths = [];
      new MutationObserver(() => {
        const bar = document.querySelector('#downloads .download:not(.failed) .bar > div');
        const width = bar && parseFloat(bar.style.width);
        if (bar && width !== window.widths[window.widths.length - 1]) window.widths.push(width);
      }).observe(document.getElementById('downloads'), {childList: true, subtree: true, attributes: true});
    }""")
    page.select_option("#model-select", "llama-3.2-1b")
    page.click("#download-model")
    page.wait_for_function("window.widths.filter((w) => w > 0 && w < 100).length >= 2", timeout=60000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tinychat-download-under-way.png"))
    assert "chat-node" in page.inner_text("#downloads") and "model-00003-of-00003.safetensors" in page.inner_text("#downloads .files")
    page.wait_for_function("document.querySelector('#model-select option[value=\"llama-3.2-1b\"]').textContent.includes('✓')", timeout=90000)
    growing = [w for w in page.evaluate("window.widths") if 0 < w < 100]
    assert len(set(growing)) >= 3 and growing == sorted(growing), growing
    page.select_option("#model-select", "llama-3.2-3b")
    page.click("#download-model")
    failure = page.wait_for_selector(".download.failed", timeout=30000).inner_text()
    assert "Could not download model llama-3.2-3b (repository unsloth/Llama-3.2-3B-Instruct" in failure and "repository not found" in failure, failure
    page.screenshot(path=str(ARTIFACTS / "tinychat-download-failed.png"))
    ask(page, "Hello")
    assert "repository not found" in page.inner_text(".message.error")
  finally:
    cluster.stop()
    hub.stop()
