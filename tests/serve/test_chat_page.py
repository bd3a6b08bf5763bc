"""The chat page in a real headless Chromium (Debian's, driven by Playwright): a person types,
sends, and the reply streams in; the screenshot is kept in the test's tmp dir and in
test-artifacts/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lmforge.inference import generate_text
from tests.serve.conftest import API_KEY, slowed

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Records the reply's text at every change while it is still streaming, to tell "streamed in pieces"
# from "appeared at once".
WATCH_REPLIES = """() => {
  window.__partials = [];
  new MutationObserver(() => {
    const live = document.querySelector('.assistant.streaming .text');
    if (live && live.textContent) window.__partials.push(live.textContent);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.mark.slow
def test_type_send_and_see_the_reply_stream_in(browser, secured, reference, tmp_path):
    model, tok = reference
    page = browser.new_page(viewport={"width": 900, "height": 640})
    page.goto(secured.url + "/")
    # the server needs a key and none is stored: ask for it
    assert page.locator("#settings").is_visible()
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.click("#toggle-settings")
    page.evaluate(WATCH_REPLIES)
    with slowed(secured.engine, 0.02):  # a token per 20 ms, so the network does not merge them
        page.fill("#input", "t5 t6 t7")
        page.keyboard.press("Enter")
        page.wait_for_selector(".assistant:not(.streaming)", timeout=30_000)
        first = generate_text(
            model, tok, ["User: t5 t6 t7\nAssistant:"], 24, temperature=0, stop=["\nUser:"]
        )[0]
        # shown without the leading space
        assert page.inner_text(".assistant .text") == first.strip()
        partials = page.evaluate("window.__partials")
        # it grew in pieces
        assert len(set(partials)) > 4 and all(first.strip().startswith(p) for p in partials)

        # A second turn: the page sends the whole conversation back.
        page.fill("#input", "t8")
        page.click("#send")
        page.wait_for_function(
            "document.querySelectorAll('.assistant:not(.streaming)').length == 2", timeout=30_000
        )
        prompt = f"User: t5 t6 t7\nAssistant: {first.strip()}\nUser: t8\nAssistant:"
        second = generate_text(model, tok, [prompt], 24, temperature=0, stop=["\nUser:"])[0]
        assert page.locator(".assistant .text").nth(1).inner_text() == second.strip()
        assert page.locator(".user").count() == 2 and page.locator(".error").count() == 0

    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / "chat.png")

    # A wrong key shows the server's error in the page instead of a reply.
    page.click("#toggle-settings")
    page.fill("#api-key", "wrong")
    page.fill("#input", "t9")
    page.keyboard.press("Enter")
    page.wait_for_selector(".error", timeout=30_000)
    assert "API key" in page.inner_text(".error")
    page.close()


@pytest.mark.slow
def test_a_long_chat_drops_its_oldest_turns_to_fit_and_says_so(browser, server, reference):
    # The quickstart path: a 128-token model. The page asks for what fits (64 tokens, not 256), and
    # when the conversation outgrows the context it leaves out its oldest turns, marks them, and
    # says so.
    model, tok = reference
    page = browser.new_page(viewport={"width": 900, "height": 640})
    page.goto(server.url + "/")
    assert page.input_value("#max-tokens") == "64"
    page.click("#toggle-settings")
    page.fill("#temperature", "0")
    page.click("#toggle-settings")
    first_msg, second_msg = (
        " ".join(f"t{i}" for i in range(5, 35)),
        " ".join(f"t{i}" for i in range(40, 70)),
    )
    page.fill("#input", first_msg)
    page.keyboard.press("Enter")
    page.wait_for_selector(".assistant:not(.streaming)", timeout=60_000)
    first = generate_text(
        model, tok, [f"User: {first_msg}\nAssistant:"], 64, temperature=0, stop=["\nUser:"]
    )[0]
    assert page.inner_text(".assistant .text") == first.strip()
    assert page.locator(".note").count() == 0
    # 30 + 30 words and the first reply do not leave 64 tokens: the first turn is left out.
    page.fill("#input", second_msg)
    page.keyboard.press("Enter")
    page.wait_for_function(
        "document.querySelectorAll('.assistant:not(.streaming)').length == 2", timeout=60_000
    )
    second = generate_text(
        model, tok, [f"User: {second_msg}\nAssistant:"], 64, temperature=0, stop=["\nUser:"]
    )[0]
    assert page.locator(".assistant .text").nth(1).inner_text() == second.strip()
    assert page.locator(".error").count() == 0
    assert "2 earlier messages left out" in page.inner_text(
        ".note"
    ) and "128-token" in page.inner_text(".note")
    assert page.locator(".msg.left-out").count() == 2  # the first question and answer, shown faded
    page.close()
