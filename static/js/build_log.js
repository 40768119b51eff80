// An image build's page, live: its log lines as they come, its state, the step being run
// and the push progress, over the build's websocket (console/consumers.py
// BuildLogConsumer). Lines are numbered; the socket is opened after the last one the page
// shows (?after=), and a line already shown is never shown twice, across reconnects too.
// It reconnects with backoff (as static/js/metrics.js) until the build has ended.
(function () {
  const box = document.getElementById("build");
  if (!box || !box.dataset.ws) return;
  const pre = document.getElementById("log");
  const FINAL = ["succeeded", "failed"];
  const kind = box.dataset.kind;
  let last = Number(box.dataset.lastSeq) || 0;
  let ended = false;
  let backoff = 1000;

  function human(n) {
    // Decimal units, as the page's `bytes` filter (console/templatetags/sizes.py).
    if (n < 1000) return `${n} B`;
    const units = ["kB", "MB", "GB", "TB", "PB"];
    let size = n;
    for (const unit of units) {
      size /= 1000;
      const text = size < 99.95 ? size.toFixed(1) : size.toFixed(0);
      if (Number(text) < 1000 || unit === "PB") return `${text.replace(/\.0$/, "")} ${unit}`;
    }
    return `${n} B`;
  }

  function show(id, text) {
    const el = document.getElementById(id);
    el.hidden = !text;
    return el;
  }

  function lines(batch) {
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 24;
    let text = "";
    for (const [seq, line] of batch) {
      if (seq <= last) continue; // shown already (the page, or before a reconnect)
      last = seq;
      text += line + "\n";
    }
    if (text) pre.append(text);
    if (atEnd) pre.scrollTop = pre.scrollHeight; // follow the end while the reader is there
  }

  function state(msg) {
    const badge = document.getElementById("build-state");
    badge.textContent = JSON.parse(badge.dataset.labels || "{}")[msg.state] || msg.state;
    badge.className = `badge badge-${msg.state} big`;
    show("build-step", msg.step).textContent = msg.step || "";
    const progress = show("build-progress", msg.total_bytes);
    if (msg.total_bytes) {
      const bar = progress.querySelector("progress");
      bar.max = msg.total_bytes;
      bar.value = msg.done_bytes;
      // The sentence comes translated from the page, with {done} and {total} to fill in.
      const text = document.getElementById("build-progress-text");
      const template = kind === "save" && msg.state === "running" ? text.dataset.committed : text.dataset.pushed;
      const values = { done: human(msg.done_bytes), total: human(msg.total_bytes) };
      text.textContent = template.replace(/\{(done|total)\}/g, (all, key) => values[key]);
    }
    show("build-error", msg.error).textContent = msg.error || "";
    const image = show("build-image", msg.image);
    if (msg.image) image.querySelector("code").textContent = msg.image;
    if (FINAL.includes(msg.state)) {
      ended = true; // the server closes the socket once the last lines are sent
      document.getElementById("follow-note").textContent = "";
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}${box.dataset.ws}?after=${last}`);
    ws.onopen = () => { backoff = 1000; };
    ws.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.lines) lines(msg.lines);
      if (msg.state) state(msg);
    };
    ws.onclose = (event) => {
      if (ended || event.code === 4404 || event.code === 4401) return; // over, or not ours
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 15000);
    };
  }
  connect();
})();
