// The chat page: a conversation with the server's model over /v1/chat/completions, streamed.
// Model output only ever reaches the page as text (render.js); the page's CSP forbids
// inline script, other origins and assigning strings as HTML.

import { ApiError, NetworkError, StreamCut, getJSON, streamEvents } from './stream.js';
import { renderText, statsText } from './render.js';

const KEY_STORAGE = 'llama-trio.api-key';
const CHAT_URL = '/v1/chat/completions';
const FOLLOW_SLACK_PX = 160; // this close to the bottom, the view follows a growing answer

const byId = (id) => document.getElementById(id);
const ui = {
  log: byId('log'),
  composer: byId('composer'),
  input: byId('input'),
  send: byId('send'),
  stop: byId('stop'),
  regenerate: byId('regenerate'),
  clear: byId('clear'),
  model: byId('model'),
  system: byId('system'),
  temperature: byId('temperature'),
  maxTokens: byId('max-tokens'),
  extra: byId('extra'),
  forgetKey: byId('forget-key'),
  keyForm: byId('key-form'),
  keyReason: byId('key-reason'),
  key: byId('key'),
};

// The conversation sent to the model: user turns, and answers that finished or were stopped.
const turns = []; // {role, content, element}
let controller = null; // the AbortController of the answer in progress
let epoch = 0; // bumped by "Clear chat": an answer from an older epoch changes nothing
let modelId = null;
let retryAfterKey = false; // an answer was refused with 401: retry it once a key is given

// -- API key ---------------------------------------------------------------------------------

function storedKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || '';
  } catch {
    return ''; // storage disabled
  }
}

function storeKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: the key is lost on reload
  }
}

function authHeaders() {
  const key = storedKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function askForKey(message) {
  ui.keyReason.textContent = `The server asks for an API key: ${message}`;
  ui.keyForm.hidden = false;
  ui.key.value = '';
  ui.key.focus();
}

ui.keyForm.addEventListener('submit', (event) => {
  event.preventDefault();
  storeKey(ui.key.value.trim());
  ui.key.value = '';
  ui.keyForm.hidden = true;
  loadModel();
  if (retryAfterKey) {
    retryAfterKey = false;
    regenerate();
  } else {
    ui.input.focus();
  }
});

ui.forgetKey.addEventListener('click', () => storeKey(''));

// -- the model's name ------------------------------------------------------------------------

async function loadModel() {
  try {
    const list = await getJSON('/v1/models', authHeaders());
    modelId = list.data?.[0]?.id ?? null;
    ui.model.textContent = modelId ?? 'no model';
  } catch (err) {
    ui.model.textContent = 'model unknown';
    if (err instanceof ApiError && err.status === 401) askForKey(err.message);
    else notice(describe(err));
  }
}

// -- the conversation view -------------------------------------------------------------------

function entry(role) {
  const element = document.createElement('article');
  element.className = `msg ${role}`;
  const label = document.createElement('div');
  label.className = 'role';
  label.textContent = role === 'user' ? 'You' : 'Assistant';
  const content = document.createElement('div');
  content.className = 'content';
  element.append(label, content);
  if (role === 'assistant') {
    const stats = document.createElement('div');
    stats.className = 'stats';
    element.append(stats);
  }
  ui.log.append(element);
  return element;
}

function notice(text) {
  const element = document.createElement('p');
  element.className = 'error';
  element.setAttribute('role', 'alert');
  element.textContent = text;
  ui.log.append(element);
  follow(true);
}

function follow(force = false) {
  const { scrollTop, scrollHeight, clientHeight } = ui.log;
  if (force || scrollHeight - scrollTop - clientHeight < FOLLOW_SLACK_PX) ui.log.scrollTop = scrollHeight;
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.regenerate.disabled = busy || !turns.some((turn) => turn.role === 'user');
  ui.log.setAttribute('aria-busy', String(busy));
}

/** What a person should read for an error that ended an answer. */
function describe(err) {
  if (err instanceof ApiError) {
    if (err.status === 0) return `The server ended the answer (${err.code ?? 'error'}): ${err.message}`;
    const what =
      {
        400: 'The server refused the request',
        401: 'The server needs an API key',
        413: 'The request is too large for the server',
        503: {
          overloaded: 'The server is busy',
          server_shutting_down: 'The server is shutting down',
          model_loading: 'The model is still loading',
        }[err.code] ?? 'The server is unavailable',
      }[err.status] ?? 'The server answered with an error';
    const retry = err.retryAfter ? ` (retry after ${err.retryAfter} s)` : '';
    return `${what} (${err.status}${err.code ? ` ${err.code}` : ''}): ${err.message}${retry}`;
  }
  if (err instanceof NetworkError) return `Cannot reach the server (${err.message}): is it running?`;
  if (err instanceof StreamCut) return `Connection lost: ${err.message}.`;
  return `Unexpected error: ${err.message}`;
}

// -- asking ----------------------------------------------------------------------------------

function requestBody() {
  const messages = [];
  if (ui.system.value.trim()) messages.push({ role: 'system', content: ui.system.value });
  for (const { role, content } of turns) messages.push({ role, content });
  const body = { model: modelId ?? 'default', messages, stream: true, stream_options: { include_usage: true } };
  if (ui.temperature.value !== '') body.temperature = Number(ui.temperature.value);
  if (ui.maxTokens.value !== '') body.max_tokens = Number(ui.maxTokens.value);
  const extra = ui.extra.value.trim();
  if (extra) {
    let fields;
    try {
      fields = JSON.parse(extra);
    } catch {
      throw new Error('the extra request fields are not valid JSON');
    }
    if (typeof fields !== 'object' || fields === null || Array.isArray(fields)) {
      throw new Error('the extra request fields must be a JSON object');
    }
    Object.assign(body, fields);
  }
  return body;
}

/** Stream the model's answer to the conversation so far into a new entry. */
async function answer() {
  let body;
  try {
    body = requestBody();
  } catch (err) {
    notice(`Not sent: ${err.message}.`);
    setBusy(false); // Regenerate sends it once the settings are fixed
    return;
  }
  const mine = epoch;
  const element = entry('assistant');
  element.classList.add('streaming');
  const content = element.querySelector('.content');
  const stats = element.querySelector('.stats');
  controller = new AbortController();
  setBusy(true);
  follow(true);
  const sent = performance.now();
  let text = '';
  let first = null;
  let last = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  const show = (ending) => {
    const tokens = usage?.completion_tokens ?? chunks;
    const ttft = first === null ? null : first - sent;
    stats.textContent = statsText({ ttft, span: last - first, tokens, usage, ending });
  };
  try {
    for await (const event of streamEvents(CHAT_URL, body, { headers: authHeaders(), signal: controller.signal })) {
      if (event.usage) usage = event.usage;
      const choice = event.choices?.[0];
      if (choice?.finish_reason) finish = choice.finish_reason;
      const delta = choice?.delta?.content;
      if (delta) {
        last = performance.now();
        first ??= last;
        chunks += 1;
        text += delta;
        renderText(content, text);
        follow();
      }
    }
    if (mine !== epoch) return; // the chat was cleared as the answer ended
    turns.push({ role: 'assistant', content: text, element });
    show(finish === 'length' ? 'reached max tokens' : '');
  } catch (err) {
    if (mine !== epoch) return; // the chat was cleared meanwhile
    if (err.name === 'AbortError') {
      if (text) turns.push({ role: 'assistant', content: text, element });
      show('stopped');
    } else {
      if (text) element.classList.add('failed');
      else element.remove();
      if (err instanceof ApiError && err.status === 401) {
        retryAfterKey = true;
        askForKey(err.message);
      }
      notice(describe(err));
    }
  } finally {
    element.classList.remove('streaming');
    if (mine === epoch) {
      controller = null;
      setBusy(false);
    }
  }
}

function send() {
  const text = ui.input.value;
  if (!text.trim() || controller) return;
  ui.input.value = '';
  const element = entry('user');
  renderText(element.querySelector('.content'), text);
  turns.push({ role: 'user', content: text, element });
  answer();
}

/** Drop the last answer (and any error after the last question) and ask again. */
function regenerate() {
  if (controller) return;
  let question = turns.length - 1;
  while (question >= 0 && turns[question].role !== 'user') question -= 1;
  if (question < 0) return;
  turns.splice(question + 1);
  const anchor = turns[question].element;
  while (anchor.nextSibling) anchor.nextSibling.remove();
  answer();
}

function stop() {
  controller?.abort();
}

function clearChat() {
  stop();
  epoch += 1;
  controller = null;
  turns.length = 0;
  ui.log.replaceChildren();
  setBusy(false);
  ui.input.focus();
}

ui.composer.addEventListener('submit', (event) => {
  event.preventDefault();
  send();
});
ui.input.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
document.addEventListener('keydown', (event) => {
  if (event.key === 'Escape' && controller) {
    event.preventDefault();
    stop();
  }
});
ui.stop.addEventListener('click', () => {
  stop();
  ui.input.focus();
});
ui.regenerate.addEventListener('click', regenerate);
ui.clear.addEventListener('click', clearChat);

setBusy(false);
loadModel();
ui.input.focus();
document.documentElement.dataset.ready = 'true'; // for tests: the script ran
