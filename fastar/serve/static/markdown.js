// Model output as HTML: markdown-it parses, highlight.js colours code, DOMPurify sanitises the result.
//
// Two walls. markdown-it runs with `html: false` (HTML in model text stays text) and accepts only http(s)
// and mailto link targets; DOMPurify then keeps only the tags and attributes listed below. The page's
// Content-Security-Policy (no inline scripts or styles) is a third. Unfinished constructs while streaming
// (an open ``` fence) render as what they will become. The libraries are vendored (see vendor/README.md).

import MarkdownIt from "/static/vendor/markdown-it.esm.min.js";
import DOMPurify from "/static/vendor/purify.es.js";
import hljs from "/static/vendor/highlight.es.min.js";

const SAFE_URL = /^(https?:|mailto:)/i;
const ALLOWED_TAGS = ["p", "br", "strong", "em", "s", "del", "code", "pre", "a", "h1", "h2", "h3", "h4", "h5", "h6",
  "ul", "ol", "li", "blockquote", "hr", "table", "thead", "tbody", "tr", "th", "td", "div", "span", "button"];
// No `style`: the CSP forbids inline styles (table alignment becomes a class below).
const ALLOWED_ATTR = ["class", "href", "target", "rel", "start", "type"];

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const md = new MarkdownIt({ html: false, linkify: true, typographer: false });
md.disable("image"); // remote images would leak the reader's address (and the CSP blocks them anyway)
md.validateLink = (url) => SAFE_URL.test(url.trim());

function highlighted(code, lang) {
  if (lang && hljs.getLanguage(lang)) {
    try {
      return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    } catch {
      // fall through to plain text
    }
  }
  return escapeHtml(code);
}

// Fenced and indented code: a bar with the language and a copy button above the highlighted block.
function codeBlock(code, info) {
  const lang = (info || "").trim().split(/\s+/)[0].toLowerCase();
  const cls = lang && hljs.getLanguage(lang) ? ` language-${escapeHtml(lang)}` : "";
  return `<div class="codeblock"><div class="codebar"><span class="lang">${escapeHtml(lang)}</span>` +
    `<button type="button" class="copy">Copy</button></div>` +
    `<pre><code class="hljs${cls}">${highlighted(code, lang)}</code></pre></div>\n`;
}
md.renderer.rules.fence = (tokens, i) => codeBlock(tokens[i].content, tokens[i].info);
md.renderer.rules.code_block = (tokens, i) => codeBlock(tokens[i].content, "");

// Table alignment as a class: markdown-it writes it as an inline style, which the CSP refuses (a console error
// even when the sanitiser drops it afterwards).
for (const rule of ["th_open", "td_open"]) {
  md.renderer.rules[rule] = (tokens, i, opts, env, self) => {
    const align = /text-align:\s*(left|center|right)/.exec(tokens[i].attrGet("style") || "");
    tokens[i].attrs = (tokens[i].attrs || []).filter(([name]) => name !== "style");
    if (align) tokens[i].attrJoin("class", `align-${align[1]}`);
    return self.renderToken(tokens, i, opts);
  };
}

// A table scrolls sideways in its own box instead of squeezing its columns to the page's width.
md.renderer.rules.table_open = (tokens, i, opts, env, self) => `<div class="tablewrap">${self.renderToken(tokens, i, opts)}`;
md.renderer.rules.table_close = (tokens, i, opts, env, self) => `${self.renderToken(tokens, i, opts)}</div>`;

// Math as the model wrote it: $…$, $$…$$, \(…\) and \[…\] stay verbatim in a span.math (no TeX renderer is
// vendored) instead of being read as markdown, where `$a*b*c$` lost its stars and `\[x\]` its backslashes. A
// price is no math: a single `$` opens before a non-space and closes after a non-space, not before a digit,
// on the same line.
const MATH = [["$$", "$$"], ["\\[", "\\]"], ["\\(", "\\)"], ["$", "$"]];
function math(state, silent) {
  const src = state.src;
  const start = state.pos;
  const pair = MATH.find(([open]) => src.startsWith(open, start));
  if (!pair) return false;
  const [open, close] = pair;
  const from = start + open.length;
  let end = src.indexOf(close, from);
  if (open === "$") {
    if (/\s/.test(src[from] || " ")) return false;
    while (end > 0 && (/\s|\\/.test(src[end - 1]) || /\d/.test(src[end + 1] || ""))) end = src.indexOf("$", end + 1);
    if (end > 0 && src.slice(from, end).includes("\n")) return false;
  }
  if (end <= from) return false;
  if (!silent) state.push("math", "span", 0).content = src.slice(start, end + close.length);
  state.pos = end + close.length;
  return true;
}
md.inline.ruler.before("escape", "math", math);
md.renderer.rules.math = (tokens, i) => `<span class="math">${escapeHtml(tokens[i].content)}</span>`;

const defaultLinkOpen = md.renderer.rules.link_open || ((tokens, i, opts, env, self) => self.renderToken(tokens, i, opts));
md.renderer.rules.link_open = (tokens, i, opts, env, self) => {
  tokens[i].attrSet("target", "_blank");
  tokens[i].attrSet("rel", "noopener noreferrer");
  return defaultLinkOpen(tokens, i, opts, env, self);
};

// ALLOWED_URI_REGEXP is checked on every attribute value not marked URI-safe: mark the ones that are no URIs.
const PURIFY = { ALLOWED_TAGS, ALLOWED_ATTR, ALLOWED_URI_REGEXP: SAFE_URL, ADD_URI_SAFE_ATTR: ["target", "rel",
  "start", "type"], ALLOW_DATA_ATTR: false, ALLOW_ARIA_ATTR: false };

export function renderMarkdown(source) {
  return DOMPurify.sanitize(md.render(String(source ?? "")), PURIFY);
}

// Where a streaming reply's text can be cut so that the part before renders the same whatever comes after:
// the last blank line outside a code fence that is followed by an unindented line (a new top-level block).
// `from` is an earlier such cut (outside any fence) to scan on from.
export function stableCut(text, from) {
  let cut = from;
  let fence = null;
  let blank = false;
  let at = from;
  // The last line may still grow, but its first character, which is all a cut before it depends on, is known.
  for (const line of text.slice(from).split("\n")) {
    const marker = /^ {0,3}(`{3,}|~{3,})/.exec(line);
    if (fence) {
      const close = /^ {0,3}(`{3,}|~{3,})\s*$/.exec(line);
      if (close && close[1][0] === fence[0] && close[1].length >= fence.length) fence = null;
    } else if (marker) {
      if (blank) cut = at;
      fence = marker[1];
    } else if (blank && /^\S/.test(line)) {
      cut = at;
    }
    blank = !fence && !line.trim();
    at += line.length + 1;
  }
  return cut;
}
