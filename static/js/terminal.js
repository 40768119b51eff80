// The web terminal (templates/console/terminal.html): xterm.js over the node's websocket
// (console/terminal.py). Binary frames both ways carry the TTY's bytes; a text frame to
// the server is a control message, {"resize": [cols, rows]}. The server takes at most
// 64 KiB in one message (more closes the terminal): input goes in pieces of PIECE bytes.
// Its words come translated from the page: data-connected and data-close-CODE (or
// data-close-other, with "{code}") on #terminal-state.
(function () {
  const box = document.getElementById("terminal");
  const state = document.getElementById("terminal-state");
  const term = new Terminal({
    cursorBlink: true,
    fontFamily: 'ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace',
    fontSize: 14,
    scrollback: 5000,
    theme: { background: "#0d1117", foreground: "#d1d9e0" },
  });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  window.suanliTerminal = term; // for the browser tests

  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const socket = new WebSocket(scheme + "//" + location.host + box.dataset.ws);
  socket.binaryType = "arraybuffer";
  const utf8 = new TextEncoder();
  const PIECE = 16384;
  const open = function () { return socket.readyState === WebSocket.OPEN; };
  const sendBytes = function (bytes) {
    for (let i = 0; i < bytes.length && open(); i += PIECE) {
      socket.send(bytes.subarray(i, i + PIECE));
    }
  };
  const sendSize = function () {
    if (open()) socket.send(JSON.stringify({ resize: [term.cols, term.rows] }));
  };

  socket.addEventListener("open", function () {
    state.textContent = state.dataset.connected;
    sendSize();
    term.focus();
  });
  socket.addEventListener("message", function (event) {
    if (typeof event.data !== "string") term.write(new Uint8Array(event.data));
  });
  socket.addEventListener("close", function (event) {
    const why = state.getAttribute("data-close-" + event.code)
      || state.dataset.closeOther.replace("{code}", event.code);
    state.textContent = why;
    term.write("\r\n\x1b[2m[" + why + "]\x1b[0m\r\n");
  });

  term.onData(function (data) { sendBytes(utf8.encode(data)); }); // keys, and pastes
  // Bytes that are not text (some mouse reports): as they are.
  term.onBinary(function (data) {
    sendBytes(Uint8Array.from(data, function (c) { return c.charCodeAt(0) & 255; }));
  });
  term.onResize(sendSize);
  window.addEventListener("resize", function () { fit.fit(); });
})();
