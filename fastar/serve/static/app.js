// fastar web chat: streams /v1/chat/completions with fetch + a body reader (EventSource cannot POST),
// keeps conversations and settings in localStorage, renders answers with markdown.js (markdown-it +
// highlight.js, sanitised by DOMPurify). Model text only ever reaches the page through textContent or
// renderMarkdown. Shows thinking in a collapsible block, tool calls, tokens/s and the prompt's progress.

import { renderMarkdown, stableCut } from "/static/markdown.js";

const STORE = "fastar.conversations.v1";
const SETTINGS = "fastar.settings.v1";
const CURRENT = "fastar.current.v1";
// thinking: a reasoning effort sent as `reasoning_effort` ("none" turns thinking off), or "" for the server's
// --reasoning-default.
const DEFAULTS = { temperature: 1.0, top_p: 1.0, max_tokens: 0, thinking: "", system: "" };
const EFFORTS = ["", "none", "low", "medium", "high", "max"];

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
};

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

let conversations = load(STORE, []).filter((c) => c && Array.isArray(c.messages));
let settings = { ...DEFAULTS, ...load(SETTINGS, {}) };
if (typeof settings.thinking === "boolean") settings.thinking = settings.thinking ? "" : "none"; // the old checkbox
if (!EFFORTS.includes(settings.thinking)) settings.thinking = DEFAULTS.thinking;
let currentId = localStorage.getItem(CURRENT) || null;
let controller = null; // the AbortController of the running request; Stop aborts it
let modelId = "deepseek-v4-flash";
let emptyState = null;

// A reply still streaming when the page went away (saved on pagehide) keeps its text and says it was cut short.
for (const c of conversations) {
  for (const m of c.messages) {
    if (!m.pending) continue;
    delete m.pending;
    m.finish = "interrupted";
  }
}
// Leaving the page ends its request too: that reads as the page going away, not as a lost connection.
let leaving = false;
window.addEventListener("beforeunload", () => (leaving = true));
window.addEventListener("pagehide", () => {
  leaving = true;
  save();
});

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    localStorage.setItem(CURRENT, currentId || "");
  } catch {
    setStatus("Could not save the conversation: browser storage is full.", "error");
  }
}

const current = () => conversations.find((c) => c.id === currentId) || null;
const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

function setStatus(text, kind = "", progress = null) {
  $("status-text").textContent = text || "";
  $("status").className = kind;
  const bar = $("prefill");
  bar.hidden = progress === null;
  if (progress !== null) bar.value = progress;
}

// ---- sidebar ---------------------------------------------------------------------------------------------

// A click in the sidebar that is refused (a reply streaming, an open edit holding changes) says why in the status
// line; on a narrow screen the open sidebar covers that line, so it closes to show it (the focus to ☰, as Escape
// leaves it). On a wide screen the sidebar is not over anything and nothing changes.
function refusedFromSidebar() {
  if (!document.body.classList.contains("show-sidebar")) return;
  document.body.classList.remove("show-sidebar");
  $("sidebar-toggle").focus();
}

function renderList() {
  const ul = $("conversations");
  // The keyboard's place in the list (a conversation's open or delete button) survives the redraw: the same button
  // of the same conversation gets the focus back, so a reply finishing does not move it away.
  const focused = ul.contains(document.activeElement) ? document.activeElement : null;
  const keep = focused && { id: focused.closest("li")?.dataset.id, delete: focused.classList.contains("delete") };
  ul.replaceChildren();
  for (const c of [...conversations].sort((a, b) => b.updated - a.updated)) {
    const li = el("li", c.id === currentId ? "active" : "");
    li.dataset.id = c.id;
    // Buttons, so the list works from the keyboard (Tab, Enter) and reads as actions to a screen reader.
    const open = el("button", "title", c.title || "New chat");
    open.type = "button";
    if (c.id === currentId) open.setAttribute("aria-current", "true");
    const del = el("button", "delete icon", "×");
    del.type = "button";
    del.title = "Delete conversation";
    del.setAttribute("aria-label", `Delete conversation: ${c.title || "New chat"}`);
    li.append(open, del);
    ul.append(li);
    if (keep && keep.id === c.id) {
      open.focus({ preventScroll: true });
      // (the delete button is hidden until its entry holds the focus, style.css: focused from there)
      if (keep.delete) del.focus({ preventScroll: true });
    }
  }
}

$("conversations").addEventListener("click", (ev) => {
  const li = ev.target.closest("li");
  if (!li) return;
  if (controller) {
    setStatus("The model is still answering: Stop it or wait before opening or deleting a conversation.");
    refusedFromSidebar();
    return;
  }
  if (editKept("opening or deleting a conversation")) {
    refusedFromSidebar();
    return;
  }
  if (ev.target.closest(".delete")) {
    conversations = conversations.filter((c) => c.id !== li.dataset.id);
    if (currentId === li.dataset.id) currentId = null;
  } else {
    currentId = li.dataset.id;
  }
  save();
  renderAll();
  document.body.classList.remove("show-sidebar");
  // The list was redrawn: keep the keyboard's place in it (the opened chat, or after a delete the first one).
  ($("conversations").querySelector("li.active .title") || $("conversations").querySelector(".title")
    || $("new-chat")).focus();
});

function newChat() {
  if (editKept("starting a new chat")) {
    refusedFromSidebar();  // (New chat is in the sidebar)
    return;
  }
  if (controller) controller.abort();
  currentId = null;
  save();
  renderAll();
  setStatus("");
  $("input").focus();
}

// ---- messages --------------------------------------------------------------------------------------------

function nearBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function scrollToBottom() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function messageView(m) {
  const view = el("div", `msg ${m.role}`);
  if (m.role === "user") {
    view.append(el("div", "bubble", m.content));
    if (m.failed) view.append(el("div", "meta", "not sent: its text is back in the message box"));
    return view;
  }
  const think = el("details", "thinking");
  think.append(el("summary", "", "Thinking"), el("div", "thinking-body"));
  view.append(think, el("div", "content markdown"), el("div", "toolcalls"), el("div", "meta"));
  updateAssistant(view, m);
  return view;
}

// The reply's markdown as HTML. While it streams (`live` given), the text up to stableCut is rendered once and
// its nodes kept; each redraw renders only the rest, so a long reply does not slow every frame down.
function drawContent(content, text, live) {
  if (!live) {
    content.innerHTML = renderMarkdown(text);
    return;
  }
  const cut = stableCut(text, live.cut);
  const nodes = (html) => {
    const template = document.createElement("template");
    template.innerHTML = html;
    return template.content;
  };
  content.querySelector(".cursor")?.remove();
  while (content.childNodes.length > live.kept) content.lastChild.remove();
  if (cut > live.cut) {
    content.append(nodes(renderMarkdown(text.slice(live.cut, cut))));
    live.cut = cut;
    live.kept = content.childNodes.length;
  }
  content.append(nodes(renderMarkdown(text.slice(cut))));
}

function updateAssistant(view, m, live = null) {
  const think = view.querySelector(".thinking");
  think.hidden = !m.reasoning;
  if (m.reasoning) {
    view.querySelector(".thinking-body").textContent = m.reasoning;
    const thinkingNow = m.pending && !m.content;
    think.querySelector("summary").textContent = thinkingNow ? "Thinking…" : "Thoughts";
    // Open while the model thinks, folded once the answer starts (the reader can reopen it).
    if (thinkingNow && !m.folded) think.open = true;
    if (m.content && !m.folded) {
      think.open = false;
      m.folded = true;
    }
  }
  const content = view.querySelector(".content");
  drawContent(content, m.content || "", m.pending ? live : null);
  if (m.pending && (m.content || !m.reasoning)) {
    // The cursor goes at the end of the text, inside the last paragraph or list item, not below it.
    let host = content;
    while (host.lastElementChild && /^(P|UL|OL|LI|BLOCKQUOTE|H\d)$/.test(host.lastElementChild.tagName)) {
      host = host.lastElementChild;
    }
    host.append(el("span", "cursor"));
  }
  nameCopyButtons(view);
  renderToolCalls(view.querySelector(".toolcalls"), m.tool_calls || []);
  view.classList.toggle("pending", !!m.pending);
  const meta = view.querySelector(".meta");
  const parts = [];
  if (m.error) parts.push(m.error);
  if (m.usage) parts.push(`${m.usage.completion_tokens} tokens`);
  else if (m.tokens) parts.push(`${m.tokens} tokens`);
  if (m.tps) parts.push(`${m.tps.toFixed(1)} tok/s`);
  if (m.finish === "length") {
    parts.push(m.content || m.tool_calls?.length || !m.reasoning ? "stopped at the token limit"
      : "the token limit was reached while thinking: no answer (raise Max tokens in Settings)");
  }
  if (m.finish === "stopped") parts.push("stopped");
  if (m.finish === "interrupted") parts.push("cut short: the page was closed or reloaded while it streamed");
  meta.textContent = parts.join(" · ");
  meta.classList.toggle("error", !!m.error);
}

// Each code block's Copy button says which block of which reply it copies ("Copy code block 2 of reply 3, python"),
// so a screen reader tells them apart: the reply numbered as its turn's Regenerate is (the questions shown above it,
// counted), the block from the reply's top. Recomputed from the page whenever a reply is drawn, so the names
// follow turns that are dropped and stay the same after a redraw or a reload. (A view not yet in the page is named
// once renderMessages has put it there.)
function nameCopyButtons(view) {
  if (!view.isConnected) return;
  let reply = 0;
  for (let at = view; at; at = at.previousElementSibling) if (at.classList.contains("user")) reply += 1;
  view.querySelectorAll(".content .codeblock").forEach((block, k) => {
    const lang = block.querySelector(".lang")?.textContent;
    const button = block.querySelector("button.copy");
    button.dataset.which = `code block ${k + 1} of reply ${reply}${lang ? `, ${lang}` : ""}`;
    copyLabel(button, button.textContent);
  });
}

// The Copy button's text ("Copy", "Copied", "Copy failed") and its accessible name, which says the same of its block.
function copyLabel(button, text) {
  button.textContent = text;
  button.setAttribute("aria-label", `${text} ${button.dataset.which}`);
}

// A tool call the model made: its name and arguments (pretty-printed when they are JSON), as text.
function renderToolCalls(box, calls) {
  box.replaceChildren();
  for (const call of calls) {
    const item = el("details", "toolcall");
    item.open = true;
    let args = call.arguments || "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming, or not JSON: shown as it is
    }
    item.append(el("summary", "", `Tool call: ${call.name || "?"}`), el("pre", "toolcall-args", args));
    box.append(item);
  }
}

function renderMessages() {
  const box = $("messages");
  const conv = current();
  $("chat-title").textContent = conv?.title || "New chat";
  box.replaceChildren();
  if (!conv || !conv.messages.length) {
    box.append(emptyState);
    return;
  }
  for (const m of conv.messages) box.append(messageView(m));
  for (const view of box.querySelectorAll(".msg.assistant")) nameCopyButtons(view);
  turnActions();
  scrollToBottom();
}

// Every answered turn can be asked again or edited, as ChatGPT does without branches. Regenerate on a reply drops
// it and every turn after it and asks its question again with the same messages before it (so the server reuses
// the conversation's state up to them). Edit on a question opens it in place; sending the edit drops that turn and
// every one after it and asks the edited question, Escape or Cancel leaves the conversation as it was.
function turnActions() {
  for (const old of $("messages").querySelectorAll(".actions")) old.remove();
  const conv = current();
  if (controller || !conv || conv.messages.some((m) => m.pending)) return; // none while a reply streams
  if (openEdit()) return; // nor while a question is edited: one edit at a time, and nothing else sent over it
  const views = $("messages").querySelectorAll(".msg");
  let turn = 0; // the turn's number as shown, counted from the top: a screen reader tells the buttons apart by it
  conv.messages.forEach((m, i) => {
    const view = views[i];
    const asked = conv.messages[i - 1];
    if (m.role === "user") turn += 1;
    if (!view || view.classList.contains("editing") || m.failed || m.pending) return;
    const actions = el("div", "actions");
    if (m.role === "user") {
      const n = turn;
      actions.append(actionButton("Edit", `Edit message ${n}`,
        "Edit this message: sending it replaces this turn and the ones after it", () => editTurn(conv, m, view, n)));
    } else if (asked?.role === "user" && !asked.failed) {
      actions.append(actionButton("Regenerate", `Regenerate reply ${turn}`,
        "Answer again: replaces this reply and the turns after it", () => resend(conv, asked, asked.content)));
    } else return;
    view.append(actions);
  });
}

// A button whose accessible name (`name`) starts with its visible label and says which turn it acts on.
function actionButton(label, name, title, action) {
  const b = el("button", "", label);
  b.type = "button";
  b.title = title;
  b.setAttribute("aria-label", name);
  b.addEventListener("click", action);
  return b;
}

// The question being edited in place, if any (its view).
const openEdit = () => $("messages").querySelector(".msg.editing");

// Whether an open edit holds changes that `doing` (opening another conversation, New chat) would drop with the
// redraw: then, as a send from the message box is refused while an edit is open, nothing is done and the status
// says why, the edit kept open with its text. An edit left unchanged loses nothing and is simply closed.
function editKept(doing) {
  const editing = openEdit();
  const box = editing?.querySelector("textarea");
  if (!box || box.value === box.defaultValue) return false;
  setStatus(`Message ${editing.dataset.turn} is open for editing: send or cancel that edit before ${doing}. `
    + "Its text is kept.");
  editing.scrollIntoView({ block: "nearest" });
  return true;
}

// The conversation up to (not including) the question `asked`, then `text` asked in its place.
function resend(conv, asked, text) {
  const at = conv.messages.indexOf(asked);
  if (controller || at < 0 || conv !== current()) return;
  conv.messages.splice(at);
  send(text);
}

function editTurn(conv, asked, view, n) {
  const form = el("form", "edit");
  const box = el("textarea");
  box.defaultValue = asked.content; // what it held when opened: an edit still equal to it has nothing to lose
  box.value = asked.content;
  box.rows = 1;
  box.setAttribute("aria-label", `Edit message ${n}`);
  const buttons = el("div", "edit-buttons");
  const cancel = actionButton("Cancel", `Cancel editing message ${n}`, "Keep the message as it was", () => {
    const shown = messageView(asked);
    view.replaceWith(shown);
    turnActions();
    setStatus(""); // (a send refused while the edit was open said why; that no longer holds)
    shown.querySelector(".actions button")?.focus(); // the keyboard stays where it was, not back at the page's top
  });
  const submit = el("button", "primary", "Send");
  submit.type = "submit";
  submit.setAttribute("aria-label", `Send edited message ${n}`);
  buttons.append(cancel, submit);
  form.append(box, buttons);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (box.value.trim()) resend(conv, asked, box.value);
    else {  // as a refused send from the message box says why; the edit stays open to be written or cancelled
      setStatus(`Message ${n} is empty: write the question, or Cancel (Escape) to keep it as it was.`);
    }
  });
  box.addEventListener("keydown", (ev) => {
    if (sendsOnEnter(ev)) {
      ev.preventDefault();
      form.requestSubmit();
    } else if (ev.key === "Escape") {
      ev.stopPropagation();
      cancel.click();
    }
  });
  box.addEventListener("input", () => autosize(box));
  view.classList.add("editing");
  view.dataset.turn = n;
  view.querySelector(".bubble").replaceWith(form);
  turnActions();
  autosize(box);
  box.focus();
  box.setSelectionRange(box.value.length, box.value.length);
}

function renderAll() {
  renderList();
  renderMessages();
}

// A page opened as http:// on another machine's address is no secure context and has no Clipboard API; there a
// selection of the code is copied instead.
async function copyText(node) {
  if (navigator.clipboard) {
    await navigator.clipboard.writeText(node.textContent);
    return;
  }
  const selection = document.getSelection();
  const range = document.createRange();
  range.selectNodeContents(node);
  selection.removeAllRanges();
  selection.addRange(range);
  const copied = document.execCommand("copy");
  selection.removeAllRanges();
  if (!copied) throw new Error("the browser refused to copy");
}

$("messages").addEventListener("click", async (ev) => {
  const button = ev.target.closest("button.copy");
  if (!button) return;
  const code = button.closest(".codeblock").querySelector("code");
  try {
    await copyText(code);
    copyLabel(button, "Copied");
  } catch {
    copyLabel(button, "Copy failed");
  }
  setTimeout(() => copyLabel(button, "Copy"), 1500);
});

// ---- streaming -------------------------------------------------------------------------------------------

// Server-sent events from a fetch body: events end at a blank line; `data:` lines carry JSON or [DONE];
// `:` lines are comments (the server's keep-alives, which also carry prefill progress).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = [];
      let comment = null;
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) comment = line.slice(1).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { data: data.join("\n") };
      else if (comment !== null) yield { comment };
    }
  }
}

async function errorText(response) {
  if (response.status === 401) return "The server needs an API key: reload the page and enter it as the password.";
  // Without the server's own message (a proxy's page, a crash) the status alone, said as what it means.
  const status = `HTTP ${response.status}${response.statusText ? " " + response.statusText : ""}`;
  const bare = response.status >= 500 ? `The server failed (${status}): its log says why.`
    : `The server refused the request (${status}).`;
  try {
    const body = await response.json();
    return body.error?.message || bare;
  } catch {
    return bare;
  }
}

function requestBody(conv) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of conv.messages) {
    if (m.pending || m.failed) continue;
    // A reply with no answer (stopped or cut by the token limit while the model still thought) is still a turn:
    // sent as an empty assistant message, which the server renders as a closed, empty reply. Left out, the
    // questions around it would reach the server as two user messages in a row, which it joins into one.
    const msg = { role: m.role, content: m.content || "" };
    if (m.tool_calls?.length) {  // resent as generated, so the server reuses the conversation's state
      msg.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function",
        function: { name: c.name, arguments: c.arguments } }));
    }
    messages.push(msg);
  }
  const body = {
    model: modelId, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number(settings.temperature), top_p: Number(settings.top_p),
  };
  if (settings.thinking) body.reasoning_effort = settings.thinking;
  if (Number(settings.max_tokens) > 0) body.max_tokens = Number(settings.max_tokens);
  return body;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
  // The list is a live region: busy while a reply streams, so a screen reader reads the reply once it is done
  // instead of every redraw of it.
  $("messages").setAttribute("aria-busy", String(busy));
}

async function send(text) {
  let conv = current();
  if (!conv) {
    conv = { id: newId(), title: "", created: Date.now(), updated: Date.now(), messages: [] };
    conversations.push(conv);
    currentId = conv.id;
  }
  const asked = { role: "user", content: text };
  conv.messages.push(asked);
  if (!conv.title) conv.title = text.replace(/\s+/g, " ").trim().slice(0, 48);
  const reply = { role: "assistant", content: "", reasoning: "", pending: true };
  conv.messages.push(reply);
  conv.updated = Date.now();
  save();
  renderAll();
  const view = $("messages").lastElementChild;
  controller = new AbortController();
  setBusy(true);
  // Sent with Send (now hidden), a turn's Regenerate or its edit box (taken away by the redraw): the keyboard goes
  // to the message box, as after Enter there, whose next Tab stop is Stop, not back to the page's top.
  if (focusLost()) $("input").focus();
  setStatus("Waiting for the model…");
  let firstToken = null;
  let frame = 0;
  const live = { cut: 0, kept: 0 }; // the part of the reply already drawn for good (drawContent)
  let finished = false; // [DONE] or a finish_reason came: the stream ended as the server meant it to
  let connected = false;
  const redraw = () => {
    frame = 0;
    const stick = nearBottom();
    updateAssistant(view, reply, live);
    if (stick) scrollToBottom();
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conv)), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    connected = true;
    for await (const ev of sseEvents(response)) {
      if (ev.comment !== undefined) {
        const m = ev.comment.match(/prefill (\d+)\/(\d+)/);
        if (m && firstToken === null) {
          const [done, total] = [Number(m[1]), Number(m[2])];
          setStatus(`Processing the prompt: ${done.toLocaleString()} / ${total.toLocaleString()} tokens`, "",
            total > 0 ? done / total : 0);
        }
        continue;
      }
      if (ev.data === "[DONE]") {
        finished = true;
        break;
      }
      const obj = JSON.parse(ev.data);
      if (obj.error) throw new Error(obj.error.message);
      if (obj.usage) reply.usage = obj.usage;
      const choice = obj.choices && obj.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const thought = delta.reasoning_content ?? delta.reasoning;
      if (thought) reply.reasoning += thought;
      if (delta.content) reply.content += delta.content;
      for (const tc of delta.tool_calls || []) {
        reply.tool_calls = reply.tool_calls || [];
        const call = (reply.tool_calls[tc.index ?? 0] ??= { id: "", name: "", arguments: "" });
        if (tc.id) call.id = tc.id;
        if (tc.function?.name) call.name += tc.function.name;
        if (tc.function?.arguments) call.arguments += tc.function.arguments;
      }
      if (choice.finish_reason) {
        reply.finish = choice.finish_reason;
        finished = true;
      }
      if (thought || delta.content) {
        reply.tokens = (reply.tokens || 0) + 1; // about one chunk per token: the live count and rate
        if (firstToken === null) {
          firstToken = performance.now();
          setStatus("");
        } else {
          const seconds = (performance.now() - firstToken) / 1000;
          if (seconds > 0.5) reply.tps = (reply.tokens - 1) / seconds;
        }
      }
      if (!frame) frame = requestAnimationFrame(redraw);
    }
    if (!finished) throw new TypeError("closed");
  } catch (err) {
    if (leaving) reply.finish = "interrupted";
    else if (err.name === "AbortError") reply.finish = "stopped";
    else if (err.name === "TypeError") {
      // fetch and the body reader fail with a TypeError when the connection fails or drops
      reply.error = connected ? "The connection to the server was lost: this reply is incomplete."
        : "Could not reach the server: is fastar serve still running?";
      if (!$("health-dot").classList.contains("error")) pollHealth(); // it keeps polling while unreachable
    } else reply.error = err.message || String(err);
    if (reply.error && !reply.content && !reply.reasoning && !reply.tool_calls?.length) {
      // Nothing came back: the turn is left out of later requests (a prompt over the context length would
      // otherwise fail every message after it), and its text goes back into the composer to edit or resend.
      asked.failed = reply.failed = true;
      if (!$("input").value.trim()) {
        $("input").value = text;
        autosize();
      }
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    const seconds = firstToken === null ? 0 : (performance.now() - firstToken) / 1000;
    if (reply.usage && seconds > 0.05) reply.tps = Math.max(reply.usage.completion_tokens - 1, 0) / seconds;
    delete reply.pending;
    if (reply.usage) delete reply.tokens; // the server's count wins; a stopped reply keeps the live one
    controller = null;
    // (Stopped by New chat, the turn stays in its conversation, which is no longer shown: its text is kept there.)
    const takenBack = reply.finish === "stopped" && conv.id === currentId && !reply.content && !reply.reasoning
      && !reply.tool_calls?.length;
    if (takenBack) takeBack(conv, asked, reply);
    else conv.updated = Date.now();
    save();
    setBusy(false);
    setStatus("");
    if (takenBack) renderAll();
    else {
      updateAssistant(view, reply);
      if (asked.failed && view.previousElementSibling) view.previousElementSibling.replaceWith(messageView(asked));
      renderList();
      turnActions();
    }
    // Back to the message box if the focus was on Stop (now hidden) or on something the redraw replaced; a
    // keyboard user who moved elsewhere while the reply streamed (a setting, an earlier reply's code) stays there.
    if (focusLost()) $("input").focus();
  }
}

// Whether the keyboard's place is gone: nothing focused, or the focused element hidden or no longer in the page.
function focusLost() {
  const at = document.activeElement;
  return !at || at === document.body || !at.isConnected || at.closest("[hidden]") !== null;
}

// Stopped before any of the reply came: the question is taken back as if it had not been sent (as claude.ai does).
// The turn leaves the conversation (a conversation left empty leaves the list) and its text returns to the message
// box to edit or send again, before whatever was typed there meanwhile, so nothing is lost.
function takeBack(conv, asked, reply) {
  conv.messages = conv.messages.filter((m) => m !== asked && m !== reply);
  if (!conv.messages.length) {
    conversations = conversations.filter((c) => c !== conv);
    currentId = null;
  }
  const typed = $("input").value;
  $("input").value = typed.trim() ? `${asked.content}\n\n${typed}` : asked.content;
  autosize();
}

// ---- composer and settings -------------------------------------------------------------------------------

function autosize(input = $("input")) {
  input.style.height = "auto";
  input.style.height = Math.min(input.scrollHeight, 240) + "px";
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value;
  if (controller && text.trim()) {
    setStatus("The model is still answering: Stop it or wait, then send. Your message is kept.");
    return;
  }
  // A question open for editing would be dropped by this send (as it would by Regenerate, hidden meanwhile):
  // nothing is sent and nothing is lost until that edit is sent or cancelled.
  const editing = openEdit();
  if (editing && text.trim()) {
    setStatus(`Message ${editing.dataset.turn} is open for editing: send or cancel that edit first. Your message `
      + "is kept.");
    editing.scrollIntoView({ block: "nearest" });
    return;
  }
  if (!text.trim() || controller) return;
  $("input").value = "";
  autosize();
  send(text);
});

// Enter sends and Shift+Enter starts a new line, except while an input method (Japanese, Chinese) composes: that
// Enter commits the composition and is the IME's. Chromium and Firefox mark it isComposing; Safari fires it after
// compositionend, with isComposing false but keyCode 229 (the key an IME is processing), so both are checked.
function sendsOnEnter(ev) {
  return ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229;
}

$("input").addEventListener("keydown", (ev) => {
  if (sendsOnEnter(ev)) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("input").addEventListener("input", () => autosize());
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", newChat);
// The narrow screen's sidebar: opened, the keyboard goes into it (it comes before the toggle in the page, and is
// out of the Tab order while closed, see style.css); Tab or Shift+Tab out of it closes it.
$("sidebar-toggle").addEventListener("click", () => {
  if (!document.body.classList.toggle("show-sidebar")) return;
  ($("conversations").querySelector("li.active .title") || $("new-chat")).focus();
});
$("sidebar").addEventListener("focusout", (ev) => {
  if (ev.relatedTarget && !$("sidebar").contains(ev.relatedTarget)) document.body.classList.remove("show-sidebar");
});
// On a narrow screen the open sidebar covers its own toggle: a tap beside it or Escape closes it.
document.querySelector("main").addEventListener("click", (ev) => {
  if (!ev.target.closest("#sidebar-toggle")) document.body.classList.remove("show-sidebar");
});
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && document.body.classList.contains("show-sidebar")) {
    document.body.classList.remove("show-sidebar");
    $("sidebar-toggle").focus();
  }
});
$("settings-toggle").addEventListener("click", () => {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
});

function bindSettings() {
  const fields = [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"],
                  ["system-prompt", "system"]];
  const show = () => {
    $("temperature-value").textContent = Number(settings.temperature).toFixed(2);
    $("top-p-value").textContent = Number(settings.top_p).toFixed(2);
  };
  for (const [id, key] of fields) {
    $(id).value = settings[key] === 0 && key === "max_tokens" ? "" : settings[key];
    $(id).addEventListener("input", () => {
      settings[key] = key === "system" ? $(id).value : Number($(id).value) || 0;
      localStorage.setItem(SETTINGS, JSON.stringify(settings));
      show();
    });
  }
  $("thinking").value = settings.thinking;
  $("thinking").addEventListener("change", () => {
    settings.thinking = $("thinking").value;
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  });
  show();
}

// ---- server status ---------------------------------------------------------------------------------------

async function pollHealth() {
  const dot = $("health-dot");
  try {
    const response = await fetch("/health");
    const body = await response.json().catch(() => ({}));
    if (response.ok) {
      const models = await fetch("/v1/models").then((r) => (r.ok ? r.json() : null)).catch(() => null);
      const model = models && models.data && models.data[0];
      if (model) {
        modelId = model.id;
        $("model-name").textContent = `${model.id} · ${Number(model.max_model_len).toLocaleString()} ctx`;
      } else {
        $("model-name").textContent = modelId;
      }
      dot.className = "dot ok";
      return;
    }
    if (response.status === 503) {
      dot.className = "dot loading";
      $("model-name").textContent = `loading the model… ${Math.round((body.progress || 0) * 100)}%`;
      setTimeout(pollHealth, 2000);
      return;
    }
    dot.className = "dot error";
    $("model-name").textContent = body.error?.message || `server error ${response.status}`;
  } catch {
    dot.className = "dot error";
    $("model-name").textContent = "server unreachable";
    setTimeout(pollHealth, 5000);
  }
}

emptyState = $("empty");
bindSettings();
renderAll();
pollHealth();
$("input").focus();
