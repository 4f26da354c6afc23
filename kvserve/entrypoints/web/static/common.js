// Shared by both pages: the API key (asked for when the server answers 401) and an SSE reader over
// fetch (EventSource cannot send an Authorization header).
"use strict";

const KEY_STORE = "kvserve.apiKey";

function apiHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = localStorage.getItem(KEY_STORE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// fetch() that, on a 401, asks for the key once and retries with it.
async function apiFetch(url, init) {
  init = init || {};
  let resp = await fetch(url, Object.assign({}, init, {headers: apiHeaders(init.headers)}));
  if (resp.status === 401) {
    const key = window.prompt("This server needs an API key:");
    if (key) {
      localStorage.setItem(KEY_STORE, key.trim());
      resp = await fetch(url, Object.assign({}, init, {headers: apiHeaders(init.headers)}));
    }
  }
  return resp;
}

async function apiError(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return resp.status + " " + resp.statusText;
  }
}

// Calls onEvent(eventName, dataString) for each server-sent event of a fetch Response.
async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}
