// Live and stored utilisation charts: one Plotly chart per measure, a trace per node (and
// per GPU). Live pages extend the traces (Plotly.extendTraces) with a 10-minute window.
// A line breaks (a null point, connectgaps off) where the samples stop for a while, e.g.
// between two jobs, so that no straight line across the gap reads as use. A job's page
// that waited for its job to start follows it with window.suanliMetrics.follow(wsUrl).
// A stored job's charts hold a decimated overview (the lowest and highest of each bucket
// of `data-step` seconds); dragging across one fetches that range at full resolution
// (data-zoom: the job's metrics.json) and redraws every chart; a double-click goes back.
// Times on the axes are the reader's (data-tz, the zone the page's text uses), not the
// browser's: a sample's `at` is its time there already (with the offset, which Plotly
// ignores); a live sample's epoch `t` is written there (wall).
(function () {
  const box = document.getElementById("metrics");
  if (!box || typeof Plotly === "undefined") return;
  const WINDOW_S = 600;
  const jobFilter = box.dataset.job ? Number(box.dataset.job) : null;
  const rdma = box.dataset.rdma === "1";
  let period = 1; // seconds between samples
  let gapS = 5; // further apart than this: a gap, not a line
  function spacing(resolution, step) {
    period = resolution === "minute" ? 60 : 1;
    // Decimated, a point pair stands for `step` seconds: points are up to a bucket apart.
    gapS = Math.max(5 * period, 2 * (Number(step) || 0));
  }
  spacing(box.dataset.resolution, box.dataset.step);
  const zone = box.dataset.tz || undefined;
  const clock = new Intl.DateTimeFormat("en-GB", { timeZone: zone, hourCycle: "h23",
    year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit" });
  // Epoch seconds as the reader's wall time, "2026-12-06 22:21:10" (what Plotly draws).
  function wall(t) {
    const p = Object.fromEntries(clock.formatToParts(new Date(t * 1000)).map((x) => [x.type, x.value]));
    return `${p.year}-${p.month}-${p.day} ${p.hour}:${p.minute}:${p.second}`;
  }
  const xOf = (s) => (s.at ? s.at.slice(0, 19).replace("T", " ") : wall(s.t));
  // The reader's wall time (as Plotly gives an axis' range) back to an instant.
  function instant(text) {
    const m = /^(\d{4})-(\d\d)-(\d\d)(?:[ T](\d\d):(\d\d)(?::(\d\d(?:\.\d+)?))?)?/.exec(text);
    if (!m) return new Date(NaN);
    const asUtc = Date.UTC(+m[1], m[2] - 1, +m[3], +(m[4] || 0), +(m[5] || 0)) + Number(m[6] || 0) * 1000;
    let guess = asUtc;
    for (let i = 0; i < 2; i++) {  // twice: right across a change of the zone's offset too
      const shown = Date.parse(wall(Math.floor(guess / 1000)).replace(" ", "T") + "Z") + (guess % 1000);
      guess = asUtc - (shown - guess);
    }
    return new Date(guess);
  }
  const gib = (b) => b / 2 ** 30;
  const refLine = (y, text) => ({
    shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: y, y1: y, line: { dash: "dot", width: 1.5, color: "#c2410c" } }],
    annotations: [{ xref: "paper", x: 1, y, xanchor: "right", yanchor: "bottom", text, showarrow: false, font: { size: 10, color: "#c2410c" } }],
  });
  // Every word shown comes translated from the page (console/_metrics.html): the charts'
  // titles as data-title, reference lines, trace names and notes as the box's data-*, the
  // names with {node} and {gpu} to fill in.
  const words = box.dataset;
  const fill = (template, values) => template.replace(/\{(\w+)\}/g, (all, key) => (key in values ? values[key] : all));
  const titled = (id) => (document.getElementById(id) || {}).dataset?.title || "";
  const gpuName = (s, i) => fill(words.traceGpu, { node: s.node, gpu: i });
  const nodeName = (s, which) => fill(words[which], { node: s.node });
  const charts = [
    { id: "chart-gpu", title: titled("chart-gpu"), layout: { yaxis: { range: [0, 105] }, ...refLine(70, words.refGpu) },
      traces: (s) => (s.gpu || []).map((v, i) => [gpuName(s, i), v]) },
    { id: "chart-gmem", title: titled("chart-gmem"), traces: (s) => (s.gmem || []).map((v, i) => [gpuName(s, i), v / 1024]) },
    { id: "chart-cpu", title: titled("chart-cpu"), traces: (s) => [[nodeName(s, "traceNode"), s.cpu_pct]] },
    { id: "chart-mem", title: titled("chart-mem"), traces: (s) => [[nodeName(s, "traceNode"), gib(s.mem_bytes)]] },
    { id: "chart-net", title: titled("chart-net"),
      layout: rdma ? { yaxis: { type: "log" }, ...refLine(100000, words.refRdma) } : {},
      traces: (s) => [[nodeName(s, "traceReceive"), (s.net_rx_bps * 8) / 1e6], [nodeName(s, "traceTransmit"), (s.net_tx_bps * 8) / 1e6]] },
    { id: "chart-disk", title: titled("chart-disk"), traces: (s) => [[nodeName(s, "traceRead"), s.disk_read_bps / 1e6], [nodeName(s, "traceWrite"), s.disk_write_bps / 1e6]] },
    { id: "chart-iops", title: titled("chart-iops"), layout: refLine(5000, words.refIops),
      traces: (s) => [[nodeName(s, "traceRead"), s.read_iops], [nodeName(s, "traceWrite"), s.write_iops]] },
  ];
  const base = {
    margin: { l: 48, r: 12, t: 30, b: 30 }, height: 230, showlegend: true,
    legend: { orientation: "h", y: -0.2, font: { size: 10 } },
    xaxis: { type: "date" }, font: { family: "system-ui, sans-serif", size: 11 },
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
  };
  // A double-click always autoranges (not first "reset" to the range a chart was drawn
  // with): on a zoomed chart it is the way back to the overview.
  const config = { displayModeBar: false, responsive: true, doubleClick: "autosize" };
  let drawn = false;
  function plot(c, range) {
    c.div = document.getElementById(c.id);
    c.index = new Map();
    c.last = new Map(); // trace name -> epoch seconds of its newest point
    // Until the first point: the last minute on the axis (not Plotly's year 2000) and 0 to
    // 1 up the side (not -1 to 6). A zoomed chart keeps its range: no autorange when its
    // points come.
    const now = Math.floor(Date.now() / 1000);
    c.empty = !range;
    const own = (c.layout || {}).yaxis || {};
    Plotly.newPlot(c.div, [], { ...base, ...(c.layout || {}), title: { text: c.title, font: { size: 12 } },
      xaxis: { ...base.xaxis, range: range ? range.map((d) => wall(d.getTime() / 1000)) : [wall(now - 60), wall(now)] },
      // Plain numbers up the side ("0.5", never "0.2μ"), and at least 0 to 1 of the unit:
      // a near-idle series (a few bytes of memory) is a flat line at the bottom, not a
      // chart of noise in millionths of a GiB.
      yaxis: { rangemode: "tozero", exponentformat: "none", ...(own.type ? {} : { autorangeoptions: { include: 1 } }),
        ...(range || own.range || own.type ? {} : { range: [0, 1] }), ...own } }, config);
    c.div.on("plotly_relayout", relayout); // newPlot drops a div's listeners: again each time
  }
  function draw() {
    drawn = true;
    for (const c of charts) plot(c, null);
  }
  function add(samples, live) {
    // The page's stored samples are already the job's own; live ones are the cluster's.
    if (live) samples = samples.filter((s) => jobFilter === null || s.job === jobFilter);
    if (!samples.length) return;
    document.getElementById("metrics-empty").hidden = true;
    for (const c of charts) {
      const grouped = new Map();
      for (const s of samples) {
        const x = xOf(s);
        for (const [name, y] of c.traces(s)) {
          if (!grouped.has(name)) grouped.set(name, { x: [], y: [] });
          const trace = grouped.get(name);
          const last = c.last.get(name);
          if (last !== undefined && s.t - last > gapS) {
            trace.x.push(wall(last + period));
            trace.y.push(null);
          }
          if (last === undefined || s.t > last) c.last.set(name, s.t);
          trace.x.push(x);
          trace.y.push(y);
        }
      }
      const fresh = [...grouped.keys()].filter((n) => !c.index.has(n));
      if (fresh.length) {
        Plotly.addTraces(c.div, fresh.map((name) => ({ name, x: [], y: [], mode: "lines", connectgaps: false, line: { width: 1.5 } })));
        for (const name of fresh) c.index.set(name, c.index.size);
      }
      const names = [...grouped.keys()];
      if (c.empty && names.length) {
        c.empty = false;
        const own = (c.layout || {}).yaxis || {};
        Plotly.relayout(c.div, { "xaxis.autorange": true, ...(own.range || own.type ? {} : { "yaxis.autorange": true }) });
      }
      Plotly.extendTraces(
        c.div,
        { x: names.map((n) => grouped.get(n).x), y: names.map((n) => grouped.get(n).y) },
        names.map((n) => c.index.get(n)),
        live ? WINDOW_S : undefined,
      );
    }
  }
  let backoff = 1000;
  let following = false;
  const grid = box.querySelector(".chartgrid");
  let history = [];
  function start() {
    history = JSON.parse(document.getElementById("metrics-history").textContent || "[]");
    // Nothing stored and nothing to come: the note says so, no empty axes.
    if (!history.length && !box.dataset.ws) grid.style.display = "none";
    draw();
    add(history, false);
    if (box.dataset.ws) follow(box.dataset.ws);
  }
  // Zoom (stored charts only: a live chart keeps following its window).
  const note = document.getElementById("metrics-note");
  const overviewNote = note.textContent;
  let zoomed = null; // [from, to] as Dates while zoomed in
  function axisDate(value) {
    // Plotly gives a date axis' range as the reader's wall time, "2026-01-05 10:00:00.5"
    // (or as milliseconds of that wall time taken as UTC).
    if (typeof value === "number") return instant(new Date(value).toISOString());
    return instant(String(value));
  }
  function redraw(samples, range, resolution, step) {
    spacing(resolution, step);
    for (const c of charts) plot(c, range);
    add(samples, false);
  }
  function relayout(event) {
    if (!box.dataset.zoom || box.dataset.ws) return;
    if (event["xaxis.autorange"]) {
      if (!zoomed) return; // the overview's own autorange
      zoomed = null;
      note.textContent = overviewNote;
      redraw(history, null, box.dataset.resolution, box.dataset.step);
      return;
    }
    const range = event["xaxis.range"] || [event["xaxis.range[0]"], event["xaxis.range[1]"]];
    if (range[0] === undefined || range[1] === undefined) return; // not the time axis
    const wanted = range.map(axisDate);
    if (wanted.some((d) => isNaN(d))) return;
    if (zoomed && wanted.every((d, i) => Math.abs(d - zoomed[i]) < 1000)) return;
    zoomed = wanted;
    const query = new URLSearchParams({ from: wanted[0].toISOString(), to: wanted[1].toISOString() });
    fetch(`${box.dataset.zoom}?${query}`, { credentials: "same-origin" })
      .then((response) => (response.ok ? response.json() : Promise.reject(response.status)))
      .then((data) => {
        if (zoomed !== wanted) return; // a newer zoom (or the overview) came first
        note.textContent = data.step
          ? fill(words.noteZoomStep, { step: data.step })
          : data.resolution === "minute" ? words.noteZoomMinute : words.noteZoomSecond;
        redraw(data.samples, wanted, data.resolution, data.step);
      })
      .catch(() => { /* the chart stays zoomed on the overview's points */ });
  }
  function follow(url) {
    if (following) return;
    following = true;
    box.dataset.ws = url;
    if (!drawn) start();
    if (grid.style.display === "none") {
      grid.style.display = "";
      for (const c of charts) Plotly.Plots.resize(c.div);
    }
    document.getElementById("metrics-note").textContent = words.noteLive;
    const empty = document.getElementById("metrics-empty");
    empty.textContent = words.noteWaiting;
    connect();
  }
  window.suanliMetrics = { follow };
  // A card that waits hidden for its job is drawn when it is shown (follow). The others are
  // drawn in a task of their own once the page is loaded (DOMContentLoaded): the page's words
  // are on screen first; drawing eight charts is a third of a first visit's script time
  // (bench/pages.py, first_visit).
  function startSoon() { setTimeout(() => { if (!drawn) start(); }, 0); }
  const navigation = performance.getEntriesByType("navigation")[0];
  if (box.closest("[hidden]")) { /* follow() draws it */ }
  else if (navigation && !navigation.domContentLoadedEventEnd) document.addEventListener("DOMContentLoaded", startSoon, { once: true });
  else startSoon();
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}${box.dataset.ws}`);
    ws.onopen = () => { backoff = 1000; };
    ws.onmessage = (event) => add(JSON.parse(event.data).samples || [], true);
    ws.onclose = (event) => {
      if (event.code === 4404 || event.code === 4401) return; // not ours: do not retry
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 15000);
    };
  }
})();
