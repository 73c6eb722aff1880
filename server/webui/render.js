// Model output on the page: always text, never HTML. Fenced code blocks become <pre><code>
// built with DOM calls; every string goes in through textContent.

const FENCE_OPEN = /^\s{0,3}```(.*)$/;
const FENCE_CLOSE = /^\s{0,3}```\s*$/;

/**
 * Text split at ``` fences: [{kind: 'text' | 'code', text, lang}]. A fence still open at the
 * end (an answer still streaming) runs to the end of the text.
 */
export function splitFences(text) {
  const parts = [];
  let lines = [];
  let lang = null; // null: outside a code block
  const flush = (kind) => {
    if (kind === 'code' || lines.length) parts.push({ kind, text: lines.join('\n'), lang: lang ?? '' });
    lines = [];
  };
  for (const line of text.split('\n')) {
    if (lang === null) {
      const open = FENCE_OPEN.exec(line);
      if (open) {
        flush('text');
        lang = open[1].trim();
      } else {
        lines.push(line);
      }
    } else if (FENCE_CLOSE.test(line)) {
      flush('code');
      lang = null;
    } else {
      lines.push(line);
    }
  }
  flush(lang === null ? 'text' : 'code');
  return parts;
}

/** Replace `element`'s children with `text`, as text and code blocks. */
export function renderText(element, text) {
  const nodes = splitFences(text).map((part) => {
    if (part.kind === 'code') {
      const pre = document.createElement('pre');
      const code = document.createElement('code');
      code.textContent = part.text;
      if (part.lang) pre.dataset.lang = part.lang;
      pre.append(code);
      return pre;
    }
    const block = document.createElement('div');
    block.className = 'text';
    block.textContent = part.text.replace(/^\n+|\n+$/g, ''); // a code block's margin is the gap
    return block;
  });
  element.replaceChildren(...nodes);
}

/**
 * One answer's statistics as a line of text. `ttft` and `span` in milliseconds (send to first
 * token; first token to last), `tokens` generated (usage when the server sent it, else the
 * content chunks counted), `usage` the usage chunk or null, `ending` a note or ''.
 */
export function statsText({ ttft, span, tokens, usage, ending }) {
  const parts = [];
  if (ttft !== null) parts.push(`TTFT ${Math.round(ttft)} ms`);
  if (tokens > 1 && span > 0) parts.push(`${((tokens - 1) / (span / 1000)).toFixed(1)} tokens/s`);
  parts.push(`${tokens} token${tokens === 1 ? '' : 's'}`);
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached}/${usage.prompt_tokens} prompt tokens cached`);
  }
  if (ending) parts.push(ending);
  return parts.join(' · ');
}
