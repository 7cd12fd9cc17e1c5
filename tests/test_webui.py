"""The web chat UI in a real browser: headless Chromium (Debian's `chromium`) driven by Python Playwright,
against a live server over the FakeEngine of test_server.py.

It loads the UI, sends a message and watches the reply stream in (thinking block included), stops a long
answer mid-stream (the server's generation stops too) and one that has not begun (the question is taken back),
checks that model markdown is rendered and model HTML is escaped, edits and regenerates earlier turns (checking the
messages the server gets, the buttons' accessible names, and that an open edit is not dropped by a send, another
conversation or New chat, nor sent empty without a word), names each code block's Copy button, keeps a
reply with no answer as a turn, keeps Enter from sending during an IME composition, walks the flow from the keyboard
(a finishing reply leaves the focus on the conversation list's entry it was on),
starts a new chat, shows a refusal from the narrow sidebar (it closes), and checks the conversation list survives
a reload. No console error or CSP violation is
allowed. A screenshot is saved under the test's tmp dir.

Skips only when Chromium or Playwright is missing; `.ci/install-browser` installs both.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from test_server import FakeEngine, start_server

from fastar.encoding import ASSISTANT, THINK_END, THINK_START, USER, render_tool_calls

CHROMIUM = os.environ.get("FASTAR_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(sync_playwright is None, reason="Python playwright is not installed (run .ci/install-browser)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (run .ci/install-browser)"),
]


@pytest.fixture
def browser_page(request):
    """A page in headless Chromium, the server, its engine (FakeEngine, or the subclass a test names with
    `@pytest.mark.parametrize("browser_page", [SomeEngine], indirect=True)`) and the page's console errors."""
    engine = getattr(request, "param", FakeEngine)(token_delay=0.02)
    server = start_server(engine)
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.set_default_timeout(15_000)
        try:
            yield page, server, engine, errors
        finally:
            browser.close()
            server.shutdown()


def send(page, text: str) -> None:
    expect(page.locator("#send")).to_be_visible()  # the previous answer is complete
    page.fill("#input", text)
    page.press("#input", "Enter")


def test_chat_streams_stops_and_starts_new_chats(browser_page, tmp_path):
    page, server, engine, errors = browser_page
    page.goto(server.url + "/")
    expect(page.locator("#health-dot")).to_have_class("dot ok")
    expect(page.locator("#model-name")).to_contain_text("deepseek-v4-flash")
    # Greedy decoding, so the fake's reply is the scripted echo (the UI's default is the model card's 1.0).
    page.click("#settings-toggle")
    page.fill("#temperature", "0")
    expect(page.locator("#temperature-value")).to_have_text("0.00")
    page.click("#settings-toggle")

    # A reply streams in; thinking is on by default and shows in its own collapsible block.
    send(page, "hello browser")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".content")).to_have_text("Echo: hello browser")
    expect(reply.locator(".thinking-body")).to_have_text("Thinking about hello browser.")
    assert reply.locator("details.thinking").get_attribute("open") is None  # folded once the answer began
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#conversations li .title")).to_have_text("hello browser")

    # A long answer: text grows while streaming; Stop ends it in the page and on the server.
    send(page, "count to a lot")
    reply = page.locator(".msg.assistant").last
    expect(page.locator("#stop")).to_be_visible()
    expect(reply.locator(".content")).to_contain_text("1 2 3 4 5")
    seen = len(reply.locator(".content").inner_text())
    page.wait_for_timeout(300)
    assert len(reply.locator(".content").inner_text()) > seen, "text did not stream in"
    expect(page.locator("#messages")).to_have_attribute("aria-busy", "true")  # read out when done, not per token
    # Enter while it streams sends nothing and says why; the typed text stays.
    page.fill("#input", "meanwhile")
    page.press("#input", "Enter")
    expect(page.locator("#status")).to_contain_text("still answering")
    expect(page.locator("#input")).to_have_value("meanwhile")
    expect(page.locator(".msg")).to_have_count(4)
    page.locator("#conversations .delete").click(force=True)  # so is a click in the list: nothing is lost
    expect(page.locator("#status")).to_contain_text("Stop it or wait before opening or deleting")
    expect(page.locator("#conversations li")).to_have_count(1)
    page.fill("#input", "")
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    expect(reply.locator(".meta")).to_contain_text("stopped")
    expect(page.locator("#messages")).to_have_attribute("aria-busy", "false")
    deadline = time.monotonic() + 5
    while server.host.num_running() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server.host.num_running(), "the server kept generating after Stop"
    generated = engine.stats()["generated_tokens"]
    stopped_text = reply.locator(".content").inner_text()
    page.wait_for_timeout(300)
    assert reply.locator(".content").inner_text() == stopped_text
    assert engine.stats()["generated_tokens"] == generated

    # Markdown is rendered; HTML in model output is shown as text, never run.
    send(page, "some markdown please")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".content h1")).to_have_text("Title")
    expect(reply.locator(".content pre code")).to_contain_text("<script>alert(1)</script>")
    expect(reply.locator(".content strong")).to_have_text("bold")
    expect(reply.locator(".content a")).to_have_attribute("href", "https://example.com")
    assert reply.locator(".content b").count() == 0 and "<b>raw html</b>" in reply.locator(".content").inner_text()
    expect(reply.locator(".content ol li")).to_have_count(2)
    page.screenshot(path=str(tmp_path / "webui-chat.png"), full_page=True)

    # Settings: thinking off -> no thinking block.
    page.click("#settings-toggle")
    page.select_option("#thinking", "none")
    page.click("#settings-toggle")
    send(page, "no thoughts")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".content")).to_have_text("Echo: no thoughts")
    expect(reply.locator("details.thinking")).to_be_hidden()

    # New chat: an empty page, a second entry in the list once it is used.
    page.click("#new-chat")
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator(".msg")).to_have_count(0)
    send(page, "second conversation")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second conversation")
    expect(page.locator("#conversations li")).to_have_count(2)

    # Conversations live in localStorage: a reload keeps both, and the first can be reopened.
    page.reload()
    expect(page.locator("#conversations li")).to_have_count(2)
    page.locator("#conversations li", has_text="hello browser").click()
    expect(page.locator(".msg.user .bubble").first).to_have_text("hello browser")
    expect(page.locator(".msg")).to_have_count(8)
    page.screenshot(path=str(tmp_path / "webui.png"), full_page=False)
    print(f"screenshots: {tmp_path / 'webui.png'}, {tmp_path / 'webui-chat.png'}")
    assert not errors, errors


def greedy(page) -> None:
    """Temperature 0 in the settings: the fake's reply is then the scripted echo."""
    page.click("#settings-toggle")
    page.fill("#temperature", "0")
    page.click("#settings-toggle")


def open_chat(page, server) -> None:
    """The page loaded, the model ready, temperature 0 (`greedy`)."""
    page.goto(server.url + "/")
    expect(page.locator("#health-dot")).to_have_class("dot ok")
    greedy(page)


def ask(page, *questions: str) -> None:
    """Send each question in turn and wait for its echoed reply."""
    for question in questions:
        send(page, question)
        expect(page.locator(".msg.assistant .content").last).to_have_text(f"Echo: {question}")


def test_ui_reports_a_loading_model_and_server_errors(browser_page):
    page, server, engine, errors = browser_page
    open_chat(page, server)
    send(page, "x" * 5000)  # longer than the fake's 4096-token context: the server's 400 is shown
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("4096")
    expect(page.locator("#send")).to_be_visible()
    # The text is back in the message box, and the turn that failed is not sent again: the next message works.
    expect(page.locator("#input")).to_have_value("x" * 5000)
    expect(page.locator(".msg.user .meta").last).to_contain_text("not sent")
    send(page, "shorter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: shorter")
    expect(page.locator(".msg.assistant .meta").last).not_to_contain_text("4096")
    assert not [e for e in errors if "400" not in e], errors  # the browser logs the failed fetch itself


def test_ui_reports_a_lost_connection(browser_page):
    """A stream cut before its end (the server's own body, truncated on the way) and a server that cannot be
    reached: each says so in the reply, never passes for a complete answer, and gives the text back."""
    page, server, engine, errors = browser_page
    open_chat(page, server)

    def truncated(route):
        events = route.fetch().text().split("\n\n")
        assert "data: [DONE]" in events
        cut = next(i for i, event in enumerate(events) if re.search(r'"finish_reason": ?"', event))
        route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body="\n\n".join(events[:cut]) + "\n\n"
        )

    page.route("**/v1/chat/completions", truncated)
    send(page, "cut short")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".meta")).to_contain_text("connection to the server was lost")
    expect(reply.locator(".meta")).to_have_class("meta error")
    expect(reply.locator(".content")).to_contain_text("Echo: cut")
    page.unroute("**/v1/chat/completions")

    # An error page that is not the server's own JSON (a proxy in front, a crash) still reads as a server failure.
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=502, body="<html>Bad Gateway</html>"))
    send(page, "behind a proxy")
    expect(page.locator(".msg.assistant .meta").last).to_have_text(
        "The server failed (HTTP 502 Bad Gateway): its log says why."
    )
    expect(page.locator("#input")).to_have_value("behind a proxy")
    page.fill("#input", "")
    page.unroute("**/v1/chat/completions")

    page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    send(page, "nobody there")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".meta")).to_contain_text("Could not reach the server")
    expect(page.locator("#input")).to_have_value("nobody there")
    expect(page.locator("#send")).to_be_visible()
    assert not [e for e in errors if "ERR_CONNECTION_REFUSED" not in e and "502" not in e], errors


def test_thinking_setting_sends_the_reasoning_effort(browser_page):
    """The Thinking setting is the API's reasoning effort; an answer cut by the token limit while the model still
    thinks says there is no answer."""
    page, server, engine, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    send(page, "default")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: default")
    assert "reasoning_effort" not in bodies[-1] and "thinking" not in bodies[-1]  # the server's default

    page.click("#settings-toggle")
    page.select_option("#thinking", "max")
    page.click("#settings-toggle")
    send(page, "think hard")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: think hard")
    assert bodies[-1]["reasoning_effort"] == "max"
    expect(page.locator(".msg.assistant .thinking-body").last).to_have_text("Thinking about think hard.")

    page.click("#settings-toggle")
    page.select_option("#thinking", "none")
    page.click("#settings-toggle")
    send(page, "no thinking")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: no thinking")
    assert bodies[-1]["reasoning_effort"] == "none"
    expect(page.locator(".msg.assistant details.thinking").last).to_be_hidden()

    page.click("#settings-toggle")
    page.select_option("#thinking", "high")
    page.fill("#max-tokens", "3")
    page.click("#settings-toggle")
    page.reload()  # the settings are kept
    expect(page.locator("#thinking")).to_have_value("high")
    send(page, "a long thought")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".meta")).to_contain_text("while thinking: no answer")
    expect(reply.locator(".thinking-body")).not_to_be_empty()
    assert bodies[-1]["reasoning_effort"] == "high" and bodies[-1]["max_tokens"] == 3
    assert not errors, errors


def test_keyboard_and_labels(browser_page):
    """The conversation list works from the keyboard; the message box has a name; Shift+Enter is a newline and
    Enter during an IME composition does not send."""
    page, server, engine, errors = browser_page
    open_chat(page, server)
    page.get_by_label("Message").fill("first chat")
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: first chat")
    page.click("#new-chat")
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("line two")
    expect(page.locator("#input")).to_have_value("line one\nline two")
    page.dispatch_event("#input", "keydown", {"key": "Enter", "isComposing": True})
    expect(page.locator(".msg")).to_have_count(0)
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: line one\nline two")
    expect(page.locator("#send")).to_be_visible()

    page.get_by_role("button", name="first chat", exact=True).focus()
    page.keyboard.press("Enter")
    expect(page.locator(".msg.user .bubble")).to_have_text(["first chat"])
    expect(page.get_by_role("button", name="first chat", exact=True)).to_have_attribute("aria-current", "true")
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Delete conversation: first chat")).to_be_focused()
    assert not errors, errors


def test_ui_behind_an_api_key():
    """With --api-key the page itself needs the key: the browser asks (Basic auth, key as the password) and then
    sends the same credentials on the UI's own API calls."""
    server = start_server(FakeEngine(), api_key="sekrit")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                context = browser.new_context(http_credentials={"username": "me", "password": "sekrit"})
                page = context.new_page()
                page.set_default_timeout(15_000)
                # Without the key (the browser's password prompt cancelled) the page says what to do.
                bare = browser.new_context().request.get(server.url + "/")
                assert bare.status == 401 and "Basic" in bare.headers["www-authenticate"]
                assert "give the key as the password" in bare.json()["error"]["message"]
                assert page.goto(server.url + "/").status == 200
                expect(page.locator("#health-dot")).to_have_class("dot ok")
                expect(page.locator("#model-name")).to_contain_text("deepseek-v4-flash")
                send(page, "count with a key")
                expect(page.locator(".msg.assistant .content").last).to_contain_text("1 2 3")
            finally:
                browser.close()
    finally:
        server.shutdown()


XSS_PAYLOADS = [
    "<img src=x onerror=alert(1)>",
    "[click](javascript:alert(1))",
    '[x](https://a.example" onmouseover="alert(1))',
    "`<script>alert(1)</script>`",
    "**<svg onload=alert(1)>**",
    '<a href="javascript:alert(1)">x</a>',
    "| a | b |\n|---|---|\n| <iframe src=x> | [y](data:text/html,hi) |",
    'see https://x.example/"><script>alert(1)</script>',
    "```\n</code></pre><img src=x onerror=alert(1)>\n```",
    "> <style>body{display:none}</style>\n- <b onclick=x>i</b>",
    "[a](mailto:me@example.com) _x_ ~~y~~ ***z***",
    "&lt;script&gt; &amp; &#x3C;img&#x3E;",
    "<details open ontoggle=window.__xss=1>",
    "[x](JaVaScRiPt:window.__xss=1)",
    "[x](  javascript:alert(1))",
    "![pixel](https://evil.example/track.png)",
    "[x](data:text/html;base64,PHNjcmlwdD4=)",
    "<a href='x'>x</a>",
    "```html\n<script>window.__xss=1</script>\n```",
    "[x](vbscript:msgbox(1)) [y](file:///etc/passwd)",
    "<math><mtext><table><mglyph><style><img src=x onerror=window.__xss=1>",
    "<<img src=x onerror=window.__xss=1>>",
    "| a |\n|--:|\n| <img src=x onerror=window.__xss=1> |",
    "`` ` `` <svg><script>window.__xss=1</script></svg>",
]
ALLOWED_TAGS = {
    "P",
    "BR",
    "STRONG",
    "EM",
    "DEL",
    "S",
    "CODE",
    "PRE",
    "A",
    "H1",
    "H2",
    "H3",
    "H4",
    "H5",
    "H6",
    "UL",
    "OL",
    "LI",
    "BLOCKQUOTE",
    "HR",
    "TABLE",
    "THEAD",
    "TBODY",
    "TR",
    "TH",
    "TD",
    "DIV",
    "SPAN",
    "BUTTON",
}
ALLOWED_ATTRS = {"class", "href", "target", "rel", "start", "type"}


def test_markdown_renderer_never_emits_unsafe_html(browser_page):
    page, server, _, errors = browser_page
    page.goto(server.url + "/")
    found = page.evaluate(
        """async (payloads) => {
        const { renderMarkdown } = await import("/static/markdown.js");
        return payloads.map((src) => {
            const box = document.createElement("div");
            document.body.append(box);  // in the live document, where handlers would fire
            box.innerHTML = renderMarkdown(src);
            return { text: box.textContent, nodes: [...box.querySelectorAll("*")].map((n) => ({
                tag: n.tagName, attrs: [...n.attributes].map((a) => [a.name, a.value]) })) };
        });
    }""",
        XSS_PAYLOADS,
    )
    for src, result in zip(XSS_PAYLOADS, found, strict=True):
        for node in result["nodes"]:
            assert node["tag"] in ALLOWED_TAGS, (src, node)
            for name, value in node["attrs"]:
                assert name in ALLOWED_ATTRS, (src, node)
                if name == "href":
                    assert value.startswith(("https://", "http://", "mailto:")), (src, value)
    assert "<img src=x onerror=alert(1)>" in found[0]["text"]  # shown as text, not dropped
    page.wait_for_timeout(200)
    assert page.evaluate("window.__xss") is None
    assert not errors, errors


RENDER_CASES = {
    "nested": "- a\n  - b\n    - c\n- d\n\n1. one\n   - sub one\n2. two",
    "underscores": "[my_link_name](https://example.com/a_b_c) and https://example.com/some_path_here_x, "
    "snake_case_word",
    "python": "```python\ndef f(x):\n    return x < 3\n```",
    "unknown": "```nosuchlang\n<b>x</b>\n```",
    "streaming": "text\n\n```js\nlet a = 1",
    "table": "| left | right |\n|:--|--:|\n| 1 | 2 |",
}


def test_markdown_rendering_nested_lists_links_and_highlighting(browser_page):
    page, server, _, errors = browser_page
    page.goto(server.url + "/")
    got = page.evaluate(
        """async (cases) => {
        const { renderMarkdown } = await import("/static/markdown.js");
        const out = {};
        for (const [name, src] of Object.entries(cases)) {
            const box = document.createElement("div");
            box.innerHTML = renderMarkdown(src);
            const q = (sel) => [...box.querySelectorAll(sel)];
            out[name] = {
                html: box.innerHTML,
                deepest: q("ul > li > ul > li > ul > li").map((n) => n.textContent),
                topItems: q(":scope > ul > li").length,
                olNested: q("ol > li > ul > li").map((n) => n.textContent),
                links: q("a").map((a) => [a.getAttribute("href"), a.textContent, a.target, a.rel]),
                ems: q("em").length,
                keywords: q("code.hljs.language-python .hljs-keyword").map((n) => n.textContent),
                codeText: q("pre code").map((n) => n.textContent),
                spans: q("pre code span").length,
                bars: q(".codeblock .codebar button.copy").length,
                langs: q(".codebar .lang").map((n) => n.textContent),
                styled: q("[style]").length,
                cells: q("td").map((n) => n.textContent),
            };
        }
        return out;
    }""",
        RENDER_CASES,
    )
    nested = got["nested"]
    assert nested["deepest"] == ["c"] and nested["topItems"] == 2 and nested["olNested"] == ["sub one"]
    links = got["underscores"]["links"]
    assert links[0] == ["https://example.com/a_b_c", "my_link_name", "_blank", "noopener noreferrer"]
    assert links[1][0] == "https://example.com/some_path_here_x" and got["underscores"]["ems"] == 0
    assert "snake_case_word" in got["underscores"]["html"]
    py = got["python"]
    assert py["keywords"][:2] == ["def", "return"] and py["bars"] == 1 and py["langs"] == ["python"]
    assert py["codeText"] == ["def f(x):\n    return x < 3\n"]
    unknown = got["unknown"]
    assert unknown["codeText"] == ["<b>x</b>\n"] and unknown["spans"] == 0
    assert got["streaming"]["codeText"] == ["let a = 1"]  # an open fence renders as the block it will be
    assert got["table"]["cells"] == ["1", "2"] and got["table"]["styled"] == 0  # no inline styles (CSP)
    assert not errors, errors


class ToolEngine(FakeEngine):
    """FakeEngine that also answers "use a tool" with a DSML tool call (no tools need to be declared)."""

    def reply(self, prompt, params):
        user = prompt.rsplit(USER, 1)[-1]
        if "use a tool" in user:
            call = render_tool_calls([{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "raw": ""}])
            return f"Thinking about tools.{THINK_END}Let me check.{call}" if prompt.endswith(THINK_START) else call
        return super().reply(prompt, params)


def test_ui_shows_tool_calls_speed_prefill_progress_and_copies_code(tmp_path):
    engine = ToolEngine(token_delay=0.005, prefill_delay=1.5)
    server = start_server(engine, keepalive_interval=0.1)
    errors: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                context = browser.new_context(viewport={"width": 1200, "height": 800})
                context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
                page = context.new_page()
                page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.set_default_timeout(15_000)
                page.goto(server.url + "/")
                expect(page.locator("#health-dot")).to_have_class("dot ok")

                # A long prompt: the prefill progress bar and count show until the first token.
                send(page, "please use a tool " + "x" * 400)
                expect(page.locator("#prefill")).to_be_visible()
                expect(page.locator("#status")).to_contain_text("Processing the prompt")
                reply = page.locator(".msg.assistant").last
                # (a generous wait: the ~150-token DSML block comes in one piece at the end, and a loaded
                # machine stretches the fake's per-token sleeps)
                expect(reply.locator(".toolcall summary")).to_have_text("Tool call: get_weather", timeout=60_000)
                expect(reply.locator(".toolcall-args")).to_have_text('{\n  "city": "Paris",\n  "days": 2\n}')
                expect(reply.locator(".content")).to_have_text("Let me check.")
                expect(page.locator("#send")).to_be_visible()
                expect(page.locator("#prefill")).to_be_hidden()
                expect(reply.locator(".meta")).to_contain_text("tok/s")
                expect(reply.locator(".meta")).to_contain_text("tokens")

                # The next turn resends the call as it was made; the server accepts the history.
                send(page, "some markdown please")
                reply = page.locator(".msg.assistant").last
                expect(reply.locator(".content pre code.hljs .hljs-keyword").first).to_have_text("def")
                reply.locator("button.copy").click()
                expect(reply.locator("button.copy")).to_have_text("Copied")
                copied = page.evaluate("navigator.clipboard.readText()")
                assert copied.startswith("def f(x):\n    return x < 3") and "<script>" in copied
                page.screenshot(path=str(tmp_path / "webui-tools.png"), full_page=True)
            finally:
                browser.close()
    finally:
        server.shutdown()
    assert not errors, errors


class LongEngine(FakeEngine):
    """FakeEngine that answers "write at length" with many short paragraphs and a code block."""

    def reply(self, prompt, params):
        user = prompt.rsplit(USER, 1)[-1]
        if "write at length" in user:
            paragraphs = [f"Paragraph {i} with **bold**." for i in range(100)]
            paragraphs.insert(3, "```python\ndef f():\n\nreturn 1\n```")
            return "\n\n".join(paragraphs)
        return super().reply(prompt, params)


def test_a_long_reply_redraws_only_its_end():
    """While a reply streams, the paragraphs already complete are drawn once and kept (a redraw renders only the
    text after them), so a long reply does not cost more per token as it grows; the finished reply is the full
    render of its text."""
    engine = LongEngine(token_delay=0.001)
    server = start_server(engine)
    errors: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page()
                page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.set_default_timeout(30_000)
                page.goto(server.url + "/")
                expect(page.locator("#health-dot")).to_have_class("dot ok")
                page.click("#settings-toggle")
                page.select_option("#thinking", "none")
                page.click("#settings-toggle")
                send(page, "write at length")
                content = page.locator(".msg.assistant .content").last
                expect(content.locator("p", has_text="Paragraph 8 ")).to_have_count(1)
                first = content.locator("p").first.element_handle()
                code = content.locator("pre code").element_handle()
                expect(content.locator("p", has_text="Paragraph 60 ")).to_have_count(1)
                assert first.evaluate("(p) => p.isConnected && p.parentNode.querySelector('p') === p")
                assert code.evaluate("(c) => c.isConnected") and code.text_content() == "def f():\n\nreturn 1\n"
                expect(page.locator("#send")).to_be_visible()
                expect(content.locator("p")).to_have_count(100)
                same = page.evaluate(
                    """async () => {
                    const { renderMarkdown } = await import("/static/markdown.js");
                    const content = [...document.querySelectorAll(".msg.assistant .content")].pop().cloneNode(true);
                    // (the page names each Copy button for its block, test_copy_buttons_say_which_code_block...)
                    for (const b of content.querySelectorAll("button.copy[aria-label]")) {
                        b.removeAttribute("aria-label");
                        b.removeAttribute("data-which");
                    }
                    const box = document.createElement("div");
                    box.innerHTML = renderMarkdown(JSON.parse(localStorage.getItem("fastar.conversations.v1"))[0]
                        .messages[1].content);
                    return box.innerHTML === content.innerHTML;
                }"""
                )
                assert same
            finally:
                browser.close()
    finally:
        server.shutdown()
    assert not errors, errors


STABLE_CUTS = {  # text -> what stableCut leaves after its cut (redrawn while the reply streams)
    "abc": "abc",
    "a\n\nb": "b",
    "a\n\nb\n\nc": "c",
    "a\n\n": "a\n\n",  # no cut before the next line's first character is known
    "a\n\n ": "a\n\n ",
    "- a\n\n  more": "- a\n\n  more",
    "```\nx\n\ny\n": "```\nx\n\ny\n",
    "x\n\n```\ny\n\nz\n```\n": "```\ny\n\nz\n```\n",
    "```\nx\n\ny\n```\n\nz": "z",
    "~~~\n```\n\nq\n~~~\n\nz": "z",
    "````\n```\n\nq": "````\n```\n\nq",
}


def test_stable_cut_never_splits_a_block(browser_page):
    page, server, _, errors = browser_page
    page.goto(server.url + "/")
    got = page.evaluate(
        """async (cases) => {
        const { stableCut } = await import("/static/markdown.js");
        return Object.keys(cases).map((text) => text.slice(stableCut(text, 0)));
    }""",
        STABLE_CUTS,
    )
    assert dict(zip(STABLE_CUTS, got, strict=True)) == STABLE_CUTS
    assert not errors, errors


MATH_CASES = {  # model text -> (the math spans' text, the rendered text)
    "Euler: $e^{i\\pi} + 1 = 0$ and $a*b*c$.": (["$e^{i\\pi} + 1 = 0$", "$a*b*c$"], None),
    "\\[ \\frac{a}{b} \\] and \\( x_1^2 \\)": (["\\[ \\frac{a}{b} \\]", "\\( x_1^2 \\)"], None),
    "$$\n\\sum_{i=1}^n i = \\frac{n(n+1)}{2}\n$$": (["$$\n\\sum_{i=1}^n i = \\frac{n(n+1)}{2}\n$$"], None),
    "costs $5 and $10, **bold**": ([], "costs $5 and $10, bold"),
    "a $ b $ c and `$x$`": ([], "a $ b $ c and $x$"),
    "$x<script>alert(1)</script>$": (["$x<script>alert(1)</script>$"], None),
}


def test_math_is_kept_as_written(browser_page):
    """TeX in model text is shown as written (no TeX renderer is vendored), not mangled as markdown; prices are
    not math."""
    page, server, _, errors = browser_page
    page.goto(server.url + "/")
    got = page.evaluate(
        """async (cases) => {
        const { renderMarkdown } = await import("/static/markdown.js");
        return Object.keys(cases).map((src) => {
            const box = document.createElement("div");
            box.innerHTML = renderMarkdown(src);
            return [[...box.querySelectorAll("span.math")].map((n) => n.textContent), box.textContent.trim(),
                    box.querySelectorAll("script, em").length];
        });
    }""",
        MATH_CASES,
    )
    for (src, (spans, text)), (got_spans, got_text, unsafe) in zip(MATH_CASES.items(), got, strict=True):
        assert got_spans == spans, src
        if text is not None:
            assert got_text == text, src
        assert unsafe == 0, src
    assert not errors, errors


def test_narrow_screen_sidebar_and_wide_tables(browser_page):
    """On a phone-sized screen the open sidebar covers its own toggle: a tap beside it or Escape closes it. A wide
    table scrolls in its own box; the page never scrolls sideways."""
    page, server, _, errors = browser_page
    page.set_viewport_size({"width": 380, "height": 740})
    page.goto(server.url + "/")
    expect(page.locator("#health-dot")).to_have_class("dot ok")
    page.click("#sidebar-toggle")
    expect(page.locator("body")).to_have_class("show-sidebar")
    page.mouse.click(340, 400)  # beside the 260-pixel sidebar
    expect(page.locator("body")).not_to_have_class("show-sidebar")
    page.click("#sidebar-toggle")
    expect(page.locator("body")).to_have_class("show-sidebar")
    page.keyboard.press("Escape")
    expect(page.locator("body")).not_to_have_class("show-sidebar")
    expect(page.locator("#sidebar-toggle")).to_be_focused()

    widths = page.evaluate(
        """async () => {
        const { renderMarkdown } = await import("/static/markdown.js");
        const box = document.createElement("div");
        box.className = "content markdown";
        const wide = "| name | b | c | d |\\n|---|---|---|---|\\n| " + "w".repeat(80) + " | 2 | 3 | 4 |";
        box.innerHTML = renderMarkdown(wide);
        document.getElementById("messages").append(box);
        const wrap = box.querySelector(".tablewrap");
        return { page: document.documentElement.scrollWidth, wrap: wrap.clientWidth, table: wrap.scrollWidth,
                 header: box.querySelector("th").getBoundingClientRect().height,
                 line: parseFloat(getComputedStyle(box.querySelector("th")).lineHeight) };
    }"""
    )
    assert widths["page"] == 380 and widths["table"] > widths["wrap"], widths
    assert widths["header"] < 2 * widths["line"], widths  # "name" on one line, not broken letter by letter
    assert not errors, errors


SIDEBAR_OPEN = re.compile(r"(^|\s)show-sidebar(\s|$)")  # among the body's classes (`busy` while a reply streams)


def status_shown(page) -> bool:
    """Whether the status line's text is what the page shows at the middle of each of its lines (not covered, by
    the sidebar say). Waits for the sidebar to have slid away first."""
    expect(page.locator("#sidebar")).to_be_hidden()
    return page.evaluate(
        """() => {
        const text = document.getElementById("status-text"), lines = [...text.getClientRects()];
        const status = document.getElementById("status");
        return text.textContent !== "" && lines.length > 0 && lines.every((r) =>
            status.contains(document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2)));
    }"""
    )


def test_a_refusal_from_the_narrow_sidebar_closes_it_to_show_why(browser_page):
    """At 400 pixels the open sidebar covers the status line: a click in it that is refused (a conversation opened
    while a reply streams; a conversation or New chat while an open edit holds changes) closes it, so the refusal
    is seen, with the focus on ☰; nothing else happens. Allowed, a conversation opens and the sidebar closes too."""
    page, server, _, errors = browser_page
    page.set_viewport_size({"width": 400, "height": 740})
    open_chat(page, server)
    ask(page, "other chat")
    page.click("#sidebar-toggle")
    page.click("#new-chat")
    send(page, "count to a lot")
    expect(page.locator(".msg.assistant .content").last).to_contain_text("1 2 3")
    page.click("#sidebar-toggle")
    expect(page.locator("body")).to_have_class(SIDEBAR_OPEN)
    page.click("#conversations li:has-text('other chat') .title")
    expect(page.locator("#status")).to_contain_text("Stop it or wait before opening or deleting a conversation")
    expect(page.locator("body")).not_to_have_class(SIDEBAR_OPEN)
    expect(page.locator("#sidebar-toggle")).to_be_focused()
    assert status_shown(page)
    expect(page.locator("#chat-title")).to_have_text("count to a lot")  # not opened
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()

    page.get_by_role("button", name="Edit message 1", exact=True).click()
    page.get_by_role("textbox", name="Edit message 1", exact=True).fill("count, edited")
    for click, doing in (("#conversations li:has-text('other chat') .title", "opening or deleting a conversation"),
                         ("#new-chat", "starting a new chat")):  # fmt: skip
        page.click("#sidebar-toggle")
        expect(page.locator("body")).to_have_class(SIDEBAR_OPEN)
        page.click(click)
        expect(page.locator("#status")).to_contain_text(f"send or cancel that edit before {doing}")
        expect(page.locator("body")).not_to_have_class(SIDEBAR_OPEN)
        assert status_shown(page), doing
    expect(page.get_by_role("textbox", name="Edit message 1", exact=True)).to_have_value("count, edited")
    page.get_by_role("textbox", name="Edit message 1", exact=True).press("Escape")
    page.click("#sidebar-toggle")
    page.click("#conversations li:has-text('other chat') .title")  # allowed now
    expect(page.locator("#chat-title")).to_have_text("other chat")
    expect(page.locator("body")).not_to_have_class(SIDEBAR_OPEN)
    assert not errors, errors


def test_copy_without_the_clipboard_api(browser_page):
    """Opened as http:// on another machine's address the page is no secure context and has no navigator.clipboard:
    Copy still copies the code (as a selection)."""
    page, server, _, errors = browser_page
    page.add_init_script("Object.defineProperty(Navigator.prototype, 'clipboard', { get: () => undefined });")
    open_chat(page, server)
    page.evaluate("document.addEventListener('copy', () => { window.copied = String(document.getSelection()); })")
    send(page, "some markdown please")
    reply = page.locator(".msg.assistant").last
    reply.locator("button.copy").click()
    expect(reply.locator("button.copy")).to_have_text("Copied")
    assert page.evaluate("window.copied").startswith("def f(x):\n    return x < 3")
    assert page.evaluate("String(document.getSelection())") == ""  # no selection is left behind
    assert not errors, errors


def test_a_reload_mid_reply_keeps_what_streamed(browser_page):
    """A page reloaded while a reply streams keeps the reply's text so far, marked as cut short (before, the
    conversation kept an empty reply)."""
    page, server, _, errors = browser_page
    page.goto(server.url + "/")
    expect(page.locator("#health-dot")).to_have_class("dot ok")
    send(page, "count to a lot")
    expect(page.locator(".msg.assistant .content").last).to_contain_text("1 2 3 4 5")
    page.reload()
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".content")).to_contain_text("1 2 3 4 5")
    expect(reply.locator(".meta")).to_contain_text("cut short")
    expect(page.locator("#send")).to_be_visible()
    deadline = time.monotonic() + 5
    while server.host.num_running() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server.host.num_running(), "the server kept generating for a page that went away"
    assert not errors, errors


def test_regenerate_and_edit_the_last_turn(browser_page):
    """Regenerate asks the last question again with the same messages before it (so the server can reuse their
    state); Edit opens the last question in place and sending it replaces the turn."""
    page, server, _, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    send(page, "first question")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: first question")
    send(page, "second question")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second question")
    expect(page.locator(".actions")).to_have_count(4)  # Edit on each question, Regenerate on each reply
    page.locator(".msg.assistant").last.get_by_role("button", name="Regenerate").click()
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second question")
    assert len(bodies) == 3 and bodies[2]["messages"] == bodies[1]["messages"]

    page.locator(".msg.user").last.get_by_role("button", name="Edit").click()
    editor = page.get_by_role("textbox", name="Edit message")
    expect(editor).to_have_value("second question")
    expect(editor).to_be_focused()
    expect(page.locator(".msg")).to_have_count(4)  # nothing is dropped before the edit is sent
    editor.fill("second question, edited")
    page.locator(".edit").get_by_role("button", name="Send").click()
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second question, edited")
    expect(page.locator(".msg")).to_have_count(4)
    assert bodies[3]["messages"][:-1] == bodies[1]["messages"][:-1]
    assert bodies[3]["messages"][-1] == {"role": "user", "content": "second question, edited"}
    page.reload()
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator(".actions")).to_have_count(4)
    assert not errors, errors


# A keydown dispatched on an element (bubbling and cancelable, as the browser's own); returns whether the page let its
# default happen, the box's text after it, and how many messages the list then shows.
DISPATCH_ENTER = """([selector, init]) => {
    const box = document.querySelector(selector);
    const ev = new KeyboardEvent("keydown", { key: "Enter", code: "Enter", bubbles: true, cancelable: true, ...init });
    const allowed = box.dispatchEvent(ev);
    return [allowed, box.value, document.querySelectorAll(".msg").length];
}"""


def test_enter_during_an_ime_composition_does_not_send(browser_page):
    """The Enter that commits a Japanese or Chinese composition is the input method's: it neither sends nor is
    cancelled, whether the browser marks it isComposing (Chromium, Firefox) or gives it keyCode 229 after
    compositionend (Safari). Enter outside a composition sends; Shift+Enter starts a new line."""
    page, server, _, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    page.fill("#input", "日本語")
    for init in ({"isComposing": True, "keyCode": 229}, {"isComposing": True}, {"keyCode": 229}):
        assert page.evaluate(DISPATCH_ENTER, ["#input", init]) == [True, "日本語", 0], init
    assert page.evaluate(DISPATCH_ENTER, ["#input", {"keyCode": 13}]) == [False, "", 2]  # the same Enter, composed
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: 日本語")

    page.fill("#input", "two")
    page.press("#input", "End")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("lines")
    expect(page.locator("#input")).to_have_value("two\nlines")
    expect(page.locator(".msg")).to_have_count(2)
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: two\nlines")
    assert [b["messages"][-1]["content"] for b in bodies] == ["日本語", "two\nlines"]
    assert not errors, errors


def saved_and_shown(page) -> tuple[list, list]:
    """The open conversation as saved in localStorage and as the page shows it: [role, text] per message (the text
    without the whitespace at its ends, which the page does not show)."""
    saved, shown = page.evaluate(
        """() => {
        const id = localStorage.getItem("fastar.current.v1");
        const conv = JSON.parse(localStorage.getItem("fastar.conversations.v1")).find((c) => c.id === id);
        const saved = conv ? conv.messages.map((m) => [m.role, m.content.trim()]) : [];
        const shown = [...document.querySelectorAll("#messages .msg")].map((v) => [
            v.classList.contains("user") ? "user" : "assistant",
            v.querySelector(".bubble, .content").innerText]);
        return [saved, shown];
    }"""
    )
    return saved, shown


def test_stop_before_the_reply_takes_the_question_back(browser_page):
    """Stop before any of the reply has come (the fake holds the request at its start) takes the question back: the
    turn leaves the conversation, saved and shown, and its text returns to the message box, before what was typed
    there meanwhile; a conversation left empty leaves the list. Stop once text has come keeps the partial reply."""
    page, server, engine, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    engine.gate.clear()
    send(page, "never answered")
    expect(page.locator("#stop")).to_be_visible()
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator("#conversations li")).to_have_count(1)
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator("#conversations li")).to_have_count(0)
    expect(page.locator("#input")).to_have_value("never answered")
    expect(page.locator("#input")).to_be_focused()
    assert page.evaluate("localStorage.getItem('fastar.conversations.v1')") == "[]"

    engine.gate.set()
    page.fill("#input", "first question")
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: first question")
    engine.gate.clear()
    send(page, "second question")
    expect(page.locator("#stop")).to_be_visible()
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator(".actions")).to_have_count(0)  # no turn is edited or asked again while one is awaited
    page.fill("#input", "typed meanwhile")
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#input")).to_have_value("second question\n\ntyped meanwhile")
    first_turn = [["user", "first question"], ["assistant", "Echo: first question"]]
    assert saved_and_shown(page) == (first_turn, first_turn)
    expect(page.locator("#conversations li .title")).to_have_text("first question")
    expect(page.locator(".msg.assistant .actions")).to_have_count(1)  # the turn before is answerable again

    engine.gate.set()
    page.fill("#input", "second question")
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second question")
    assert bodies[-1]["messages"] == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "Echo: first question"},
        {"role": "user", "content": "second question"},
    ]

    send(page, "count to a lot")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".content")).to_contain_text("1 2 3")
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    expect(reply.locator(".meta")).to_contain_text("stopped")
    expect(reply.locator(".content")).to_contain_text("1 2 3")
    expect(page.locator("#input")).to_have_value("")
    saved, shown = saved_and_shown(page)
    assert len(saved) == 6 and saved == shown and saved[-1][1].startswith("1 2 3")
    assert not errors, errors


def test_regenerate_and_edit_an_earlier_turn(browser_page, tmp_path):
    """On a three-turn conversation: Regenerate on the first reply drops it and the turns after it and asks the
    first question again with exactly the messages before it; Edit on the second question (Escape first leaves it
    as it was) drops that turn and the one after it and asks the edited question after exactly the first turn. What
    is saved is what is shown, before and after a reload."""
    page, server, _, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)

    def turns(*questions: str) -> list:
        return [x for q in questions for x in (["user", q], ["assistant", f"Echo: {q}"])]

    def sent(*questions: str) -> list:
        return [{"role": r, "content": c} for r, c in turns(*questions)][:-1]

    ask(page, "first question", "second question", "third question")
    page.locator(".msg.assistant").first.hover()
    page.screenshot(path=str(tmp_path / "webui-turn-actions.png"), full_page=True)
    page.locator(".msg.assistant").first.get_by_role("button", name="Regenerate").click()
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".msg")).to_have_count(2)
    assert len(bodies) == 4 and bodies[3]["messages"] == sent("first question") == bodies[0]["messages"]
    assert saved_and_shown(page) == (turns("first question"),) * 2

    ask(page, "second question", "third question")
    assert bodies[-1]["messages"] == sent("first question", "second question", "third question")
    second = page.locator(".msg.user").nth(1)
    second.get_by_role("button", name="Edit").click()
    editor = page.get_by_role("textbox", name="Edit message")
    expect(editor).to_have_value("second question")
    editor.press("Escape")
    expect(editor).to_have_count(0)
    expect(second.locator(".bubble")).to_have_text("second question")
    expect(second.get_by_role("button", name="Edit")).to_be_focused()
    assert saved_and_shown(page) == (turns("first question", "second question", "third question"),) * 2

    second.get_by_role("button", name="Edit").click()
    editor.fill("second, edited")
    page.screenshot(path=str(tmp_path / "webui-edit.png"), full_page=True)
    assert page.evaluate(DISPATCH_ENTER, [".edit textarea", {"keyCode": 229}]) == [True, "second, edited", 6]  # IME
    editor.press("Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second, edited")
    expect(page.locator("#send")).to_be_visible()
    assert len(bodies) == 7 and bodies[-1]["messages"] == sent("first question", "second, edited")
    assert saved_and_shown(page) == (turns("first question", "second, edited"),) * 2
    page.reload()
    expect(page.locator(".msg")).to_have_count(4)
    assert saved_and_shown(page) == (turns("first question", "second, edited"),) * 2
    assert not errors, errors


class PonderingEngine(FakeEngine):
    """FakeEngine that thinks at length (two thousand numbers) before it answers a question starting "ponder"."""

    def reply(self, prompt, params):
        user = prompt.rsplit(USER, 1)[-1].split(ASSISTANT, 1)[0]
        if user.startswith("ponder") and prompt.endswith(THINK_START):
            return " ".join(str(i) for i in range(1, 2000)) + f"{THINK_END}Pondered."
        return super().reply(prompt, params)


@pytest.mark.parametrize("browser_page", [PonderingEngine], indirect=True)
def test_a_reply_without_an_answer_keeps_its_turn(browser_page):
    """A reply stopped while the model still thought, or cut there by the token limit, has no answer but is a turn:
    the next request carries it as an empty assistant message (which the server renders as a closed, empty reply),
    so the questions around it stay two turns, as shown, instead of reaching the model as one user message."""
    page, server, _, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    send(page, "ponder this")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".thinking-body")).to_contain_text("1 2 3")
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    expect(reply.locator(".meta")).to_contain_text("stopped")
    expect(reply.locator(".content")).to_have_text("")
    send(page, "next question")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: next question")  # what the model read
    assert bodies[-1]["messages"] == [
        {"role": "user", "content": "ponder this"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "next question"},
    ]

    page.click("#settings-toggle")
    page.fill("#max-tokens", "3")
    page.click("#settings-toggle")
    send(page, "a long thought")
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("while thinking: no answer")
    page.click("#settings-toggle")
    page.fill("#max-tokens", "")
    page.click("#settings-toggle")
    send(page, "after the limit")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: after the limit")
    assert bodies[-1]["messages"] == [
        {"role": "user", "content": "ponder this"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "next question"},
        {"role": "assistant", "content": "Echo: next question"},
        {"role": "user", "content": "a long thought"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "after the limit"},
    ]
    saved, shown = saved_and_shown(page)
    assert saved == shown and len(saved) == 8
    assert not errors, errors


def expect_names(page, selector: str, names: list[str]) -> None:
    """The buttons `selector` finds in the conversation shown, top to bottom, have these accessible names."""
    buttons = page.locator(selector)
    expect(buttons).to_have_count(len(names))
    for i, name in enumerate(names):
        expect(buttons.nth(i)).to_have_accessible_name(name)


def expect_turn_buttons(page, names: list[str]) -> None:
    """The Edit and Regenerate buttons, top to bottom."""
    expect_names(page, "#messages .actions button", names)


def test_turn_buttons_say_which_turn(browser_page):
    """Each Edit and Regenerate button's accessible name says which turn it acts on (numbered as shown, a turn
    that was not sent included), and the numbers follow the turns when some are dropped; the edit box and its
    buttons say which message they edit."""
    page, server, _, errors = browser_page
    open_chat(page, server)
    ask(page, "first question", "second question", "third question")
    turns = lambda *ns: [f"{kind} {n}" for n in ns for kind in ("Edit message", "Regenerate reply")]  # noqa: E731
    expect_turn_buttons(page, turns(1, 2, 3))

    page.get_by_role("button", name="Regenerate reply 2", exact=True).click()
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: second question")
    expect(page.locator(".msg")).to_have_count(4)
    expect_turn_buttons(page, turns(1, 2))

    page.get_by_role("button", name="Edit message 2", exact=True).click()
    expect(page.get_by_role("textbox", name="Edit message 2", exact=True)).to_be_focused()
    expect(page.get_by_role("button", name="Send edited message 2", exact=True)).to_be_visible()
    page.get_by_role("button", name="Cancel editing message 2", exact=True).click()
    expect_turn_buttons(page, turns(1, 2))

    send(page, "x" * 5000)  # over the fake's context: shown, not sent, and without buttons
    expect(page.locator(".msg.user .meta").last).to_contain_text("not sent")
    page.fill("#input", "")
    send(page, "fourth question")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: fourth question")
    expect_turn_buttons(page, turns(1, 2, 4))
    assert not [e for e in errors if "400" not in e], errors  # the browser logs the failed fetch itself


def expect_copy_buttons(page, names: list[str]) -> None:
    """The code blocks' Copy buttons, top to bottom."""
    expect_names(page, "#messages button.copy", names)


def test_copy_buttons_say_which_code_block_of_which_reply(browser_page):
    """Each code block's Copy button is named for its block and reply ("Copy code block 2 of reply 1"), with the
    block's language when it has one, so a screen reader tells them apart; the names follow a dropped turn, stay
    the same after a reload, and say "Copied" of the same block once it is copied."""
    page, server, _, errors = browser_page
    open_chat(page, server)
    for question in ("first", "second", "third"):  # the fake echoes the question: two code blocks in each reply
        send(page, f"{question}\n```python\nx = 1\n```\nthen\n```\nplain\n```")
        expect(page.locator(".msg.assistant").last.locator("button.copy")).to_have_count(2)
    expect(page.locator("#send")).to_be_visible()
    blocks = lambda *ns: [  # noqa: E731
        f"Copy code block {k} of reply {n}{lang}" for n in ns for k, lang in ((1, ", python"), (2, ""))
    ]
    expect_copy_buttons(page, blocks(1, 2, 3))
    page.get_by_role("button", name="Regenerate reply 2", exact=True).click()
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator("#send")).to_be_visible()
    expect_copy_buttons(page, blocks(1, 2))
    page.reload()
    expect_copy_buttons(page, blocks(1, 2))
    page.get_by_role("button", name="Copy code block 2 of reply 2", exact=True).click()
    expect(page.locator("#messages button.copy").nth(3)).to_have_accessible_name("Copied code block 2 of reply 2")
    expect(page.locator("#messages button.copy").nth(3)).to_have_accessible_name("Copy code block 2 of reply 2")
    assert not errors, errors


def test_a_send_from_the_message_box_keeps_an_open_edit(browser_page):
    """While a question is open for editing, a message sent from the message box (Enter or Send) is refused with a
    status naming the open edit, and both texts are kept: sending it would drop the edited turn. The other turns
    offer no Edit or Regenerate meanwhile (one edit at a time); once the edit is cancelled the message sends."""
    page, server, _, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    ask(page, "first question", "second question")
    page.get_by_role("button", name="Edit message 1", exact=True).click()
    editor = page.get_by_role("textbox", name="Edit message 1", exact=True)
    editor.fill("first, half edited")
    expect_turn_buttons(page, [])
    page.fill("#input", "a new question")
    page.press("#input", "Enter")
    expect(page.locator("#status")).to_have_text(
        "Message 1 is open for editing: send or cancel that edit first. Your message is kept."
    )
    page.click("#send")
    expect(page.locator("#input")).to_have_value("a new question")
    expect(editor).to_have_value("first, half edited")
    expect(page.locator(".msg")).to_have_count(4)
    assert len(bodies) == 2

    editor.press("Escape")
    expect(page.locator("#status")).to_have_text("")
    expect_turn_buttons(page, ["Edit message 1", "Regenerate reply 1", "Edit message 2", "Regenerate reply 2"])
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: a new question")
    assert [m["content"] for m in bodies[-1]["messages"]] == [
        "first question",
        "Echo: first question",
        "second question",
        "Echo: second question",
        "a new question",
    ]
    assert not errors, errors


def test_an_open_edit_is_never_dropped_without_a_word(browser_page):
    """An edit sent empty (or only whitespace) is not sent and the status says why, the edit left open; opening
    another conversation or New chat while an edit holds changes is refused the same way, the edit kept open with
    its text, as a send from the message box is. Cancelled, or left unchanged, nothing is lost and they go ahead."""
    page, server, _, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    send(page, "other chat")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: other chat")
    page.click("#new-chat")
    ask(page, "first question", "second question")

    page.get_by_role("button", name="Edit message 1", exact=True).click()
    editor = page.get_by_role("textbox", name="Edit message 1", exact=True)
    for empty in ("", "  \n "):
        editor.fill(empty)
        editor.press("Enter") if empty else page.get_by_role("button", name="Send edited message 1").click()
        expect(page.locator("#status")).to_have_text(
            "Message 1 is empty: write the question, or Cancel (Escape) to keep it as it was."
        )
        expect(editor).to_have_value(empty)
        page.evaluate("document.getElementById('status-text').textContent = ''")
    assert len(bodies) == 3

    editor.fill("first, half edited")
    for click, doing in (("#conversations li:has-text('other chat') .title", "opening or deleting a conversation"),
                         ("#conversations li:has-text('other chat') .delete", "opening or deleting a conversation"),
                         ("#new-chat", "starting a new chat")):  # fmt: skip
        page.click(click)
        expect(page.locator("#status")).to_have_text(
            f"Message 1 is open for editing: send or cancel that edit before {doing}. Its text is kept."
        )
        page.evaluate("document.getElementById('status-text').textContent = ''")
    expect(editor).to_have_value("first, half edited")
    expect(page.locator("#chat-title")).to_have_text("first question")
    expect(page.locator("#conversations li")).to_have_count(2)

    editor.fill("first question")  # back as it was: nothing to lose, so the edit is closed and the chat opened
    page.click("#conversations li:has-text('other chat') .title")
    expect(page.locator("#chat-title")).to_have_text("other chat")
    expect(page.locator(".msg.editing")).to_have_count(0)
    page.click("#conversations li:has-text('first question') .title")
    page.get_by_role("button", name="Edit message 1", exact=True).click()
    editor.fill("changed")
    editor.press("Escape")  # cancelled: New chat goes ahead
    page.click("#new-chat")
    expect(page.locator("#chat-title")).to_have_text("New chat")
    assert len(bodies) == 3 and not errors, errors


def test_a_reply_finishing_keeps_the_focus_on_a_conversation_in_the_list(browser_page):
    """The conversation list is redrawn when a reply finishes; a keyboard user whose focus is on a conversation
    there (its open or delete button) keeps it on the same button of the same conversation. (The fake holds each
    request at its start while the gate is clear.)"""
    page, server, engine, errors = browser_page
    open_chat(page, server)
    send(page, "other chat")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: other chat")
    page.click("#new-chat")
    for title, delete in (("other chat", False), ("other chat", True), ("a question", False)):
        engine.gate.clear()
        send(page, "a question")
        expect(page.locator("#stop")).to_be_visible()
        page.get_by_role("button", name=title, exact=True).focus()
        if delete:  # shown once its entry holds the focus
            page.keyboard.press("Tab")
        entry = page.get_by_role("button", name=f"Delete conversation: {title}" if delete else title, exact=True)
        expect(entry).to_be_focused()
        engine.gate.set()
        expect(page.locator("#send")).to_be_visible()
        expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: a question")
        expect(entry).to_be_focused()
    assert not errors, errors


def test_the_whole_flow_from_the_keyboard(browser_page):
    """Keyboard only: after a send the focus is in the message box and the next Tab is Stop; Stop (Enter) gives the
    focus back to the message box; Regenerate and an edit sent with Enter leave it there too, not on the page (the
    button or box they were sent from is gone); Escape in an edit goes back to its Edit button, and the Enter that
    opened the edit does not reach the edit box. A reply finishing never takes the focus from where the user moved
    it meanwhile. (The fake holds each request at its start while the gate is clear.)"""
    page, server, engine, errors = browser_page
    bodies: list[dict] = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(r.post_data_json))
    open_chat(page, server)
    message_box = page.locator("#input")
    message_box.focus()
    page.keyboard.type("first question")
    page.keyboard.press("Enter")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: first question")
    expect(message_box).to_be_focused()

    engine.gate.clear()
    page.keyboard.type("never answered")
    page.keyboard.press("Enter")
    expect(message_box).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.locator("#stop")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("#send")).to_be_visible()
    expect(message_box).to_be_focused()
    expect(message_box).to_have_value("never answered")  # taken back: nothing had come
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")

    page.get_by_role("button", name="Regenerate reply 1", exact=True).focus()
    page.keyboard.press("Enter")
    expect(page.locator("#stop")).to_be_visible()
    expect(message_box).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.locator("#stop")).to_be_focused()
    page.locator("#settings-toggle").focus()  # the user moves on while the reply comes
    engine.gate.set()
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: first question")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#settings-toggle")).to_be_focused()
    assert len(bodies) == 3 and bodies[2]["messages"] == bodies[0]["messages"]

    edit = page.get_by_role("button", name="Edit message 1", exact=True)
    edit.focus()
    page.keyboard.press("Enter")
    editor = page.get_by_role("textbox", name="Edit message 1", exact=True)
    expect(editor).to_be_focused()
    expect(editor).to_have_value("first question")
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Cancel editing message 1", exact=True)).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Send edited message 1", exact=True)).to_be_focused()
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Shift+Tab")
    expect(editor).to_be_focused()
    page.keyboard.press("Escape")
    expect(edit).to_be_focused()
    page.keyboard.press("Enter")
    expect(editor).to_be_focused()
    page.keyboard.type(", edited")
    engine.gate.clear()
    page.keyboard.press("Enter")
    expect(page.locator("#stop")).to_be_visible()
    expect(message_box).to_be_focused()
    engine.gate.set()
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: first question, edited")
    expect(message_box).to_be_focused()
    assert bodies[-1]["messages"] == [{"role": "user", "content": "first question, edited"}]
    assert not errors, errors


def test_the_narrow_sidebar_from_the_keyboard(browser_page):
    """On a narrow screen the closed sidebar is off screen and out of the Tab order; ☰ (Enter) opens it with the
    focus on the open conversation, and Tab past its end closes it again, the focus on ☰."""
    page, server, _, errors = browser_page
    page.set_viewport_size({"width": 380, "height": 740})
    open_chat(page, server)
    send(page, "a question")
    expect(page.locator(".msg.assistant .content").last).to_have_text("Echo: a question")
    in_sidebar = "() => document.getElementById('sidebar').contains(document.activeElement)"
    page.locator("#input").focus()
    for _ in range(12):  # round the page more than once: nothing in the sidebar is reached
        page.keyboard.press("Tab")
        assert not page.evaluate(in_sidebar)
    page.locator("#sidebar-toggle").focus()
    page.keyboard.press("Enter")
    expect(page.locator("body")).to_have_class("show-sidebar")
    expect(page.get_by_role("button", name="a question", exact=True)).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Delete conversation: a question")).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.locator("body")).not_to_have_class("show-sidebar")
    expect(page.locator("#sidebar-toggle")).to_be_focused()
    assert not errors, errors
