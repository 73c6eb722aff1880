// Streaming a chat completion: fetch, the response body's reader, and a parser for
// Server-Sent Events. Nothing here touches the page.

/** A server's error answer: a non-2xx status, or an error event inside a stream (status 0). */
export class ApiError extends Error {
  constructor(status, message, code = null, retryAfter = null) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

/** fetch() itself failed: the server could not be reached. */
export class NetworkError extends Error {
  constructor(cause) {
    super(cause?.message || 'network error');
    this.name = 'NetworkError';
  }
}

/** The stream stopped before `data: [DONE]`: the connection was lost or closed early. */
export class StreamCut extends Error {
  constructor(message) {
    super(message);
    this.name = 'StreamCut';
  }
}

/**
 * Server-Sent Events as the WHATWG spec parses them, fed text as it arrives: lines end with
 * CRLF, LF or CR (also split between two reads), `:` lines are comments (our `: ping`), a
 * blank line ends an event, and an event's `data:` lines are joined with a newline.
 */
export class SSEParser {
  constructor() {
    this.partial = '';
    this.data = [];
    this.afterCR = false;
  }

  /** The data of every event this text completes, in order. */
  feed(text) {
    if (text === '') return [];
    if (this.afterCR && text.startsWith('\n')) text = text.slice(1);
    this.afterCR = text.endsWith('\r');
    const lines = (this.partial + text).split(/\r\n|\r|\n/);
    this.partial = lines.pop();
    const events = [];
    for (const line of lines) {
      if (line === '') {
        if (this.data.length) events.push(this.data.join('\n'));
        this.data = [];
      } else if (!line.startsWith(':')) {
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? '' : line.slice(colon + 1);
        if (value.startsWith(' ')) value = value.slice(1);
        if (field === 'data') this.data.push(value);
      }
    }
    return events;
  }
}

/** The ApiError for a non-2xx response, with the server's own message when it sent one. */
export async function errorOf(response) {
  let message = response.statusText || `HTTP ${response.status}`;
  let code = null;
  try {
    const text = await response.text();
    message = text || message;
    const error = JSON.parse(text)?.error;
    if (error?.message) {
      message = String(error.message);
      code = error.code ?? null;
    }
  } catch {
    // not JSON (or the body broke off): keep what we have
  }
  return new ApiError(response.status, message, code, response.headers.get('Retry-After'));
}

async function request(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    if (err.name === 'AbortError') throw err;
    throw new NetworkError(err);
  }
}

/** GET a JSON document; throws ApiError, NetworkError. */
export async function getJSON(url, headers = {}) {
  const response = await request(url, { headers });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

/**
 * POST `body` as JSON and yield each event of the SSE answer, parsed, until `data: [DONE]`.
 * Throws ApiError (non-2xx, or an error event), NetworkError, StreamCut, and an AbortError
 * when `signal` aborts (the browser closes the connection; the server then frees the sequence).
 */
export async function* streamEvents(url, body, { headers = {}, signal } = {}) {
  const response = await request(url, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Accept: 'text/event-stream', ...headers },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  let done = false;
  let ended = false;
  try {
    while (!ended) {
      let read;
      try {
        read = await reader.read();
      } catch (err) {
        if (err.name === 'AbortError') throw err;
        throw new StreamCut('the connection was lost before the answer was complete');
      }
      ended = read.done;
      for (const data of ended ? [] : parser.feed(read.value)) {
        if (done) continue;
        if (data === '[DONE]') {
          done = true; // read on to the body's end, so the connection stays reusable
          continue;
        }
        const event = JSON.parse(data);
        if (event.error) {
          const { message, code } = event.error;
          throw new ApiError(0, String(message ?? 'error'), code ?? null);
        }
        yield event;
      }
    }
  } finally {
    if (!ended) reader.cancel().catch(() => {});
  }
  if (!done) throw new StreamCut('the stream ended before the answer was complete');
}
