// Live and stored utilisation charts: one Plotly chart per measure, a trace per node (and
// per GPU). Live pages extend the traces (Plotly.extendTraces) with a 10-minute window.
// A line breaks (a null point, connectgaps off) where the samples stop for a while, e.g.
// between two jobs, so that no straight line across the gap reads as use. A job's page
// that waited for its job to start follows it with window.suanliMetrics.follow(wsUrl).
(function () {
  const box = document.getElementById("metrics");
  if (!box || typeof Plotly === "undefined") return;
  const WINDOW_S = 600;
  const jobFilter = box.dataset.job ? Number(box.dataset.job) : null;
  const rdma = box.dataset.rdma === "1";
  const period = box.dataset.resolution === "minute" ? 60 : 1; // seconds between samples
  const GAP_S = 5 * period; // further apart than this: a gap, not a line
  const gib = (b) => b / 2 ** 30;
  const refLine = (y, text) => ({
    shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: y, y1: y, line: { dash: "dot", width: 1.5, color: "#c2410c" } }],
    annotations: [{ xref: "paper", x: 1, y, xanchor: "right", yanchor: "bottom", text, showarrow: false, font: { size: 10, color: "#c2410c" } }],
  });
  const charts = [
    { id: "chart-gpu", title: "GPU utilisation (%)", layout: { yaxis: { range: [0, 105] }, ...refLine(70, "70 % target") },
      traces: (s) => (s.gpu || []).map((v, i) => [`node ${s.node} · GPU ${i}`, v]) },
    { id: "chart-gmem", title: "GPU memory (GiB)", traces: (s) => (s.gmem || []).map((v, i) => [`node ${s.node} · GPU ${i}`, v / 1024]) },
    { id: "chart-cpu", title: "CPU (% of one core)", traces: (s) => [[`node ${s.node}`, s.cpu_pct]] },
    { id: "chart-mem", title: "Memory (GiB)", traces: (s) => [[`node ${s.node}`, gib(s.mem_bytes)]] },
    { id: "chart-net", title: "Network (Mbit/s)",
      layout: rdma ? { yaxis: { type: "log" }, ...refLine(100000, "100 Gbit/s RDMA link") } : {},
      traces: (s) => [[`node ${s.node} receive`, (s.net_rx_bps * 8) / 1e6], [`node ${s.node} transmit`, (s.net_tx_bps * 8) / 1e6]] },
    { id: "chart-disk", title: "Disk (MB/s)", traces: (s) => [[`node ${s.node} read`, s.disk_read_bps / 1e6], [`node ${s.node} write`, s.disk_write_bps / 1e6]] },
    { id: "chart-iops", title: "Storage IOPS", layout: refLine(5000, "5,000 IOPS"),
      traces: (s) => [[`node ${s.node} read`, s.read_iops], [`node ${s.node} write`, s.write_iops]] },
  ];
  const base = {
    margin: { l: 48, r: 12, t: 30, b: 30 }, height: 230, showlegend: true,
    legend: { orientation: "h", y: -0.2, font: { size: 10 } },
    xaxis: { type: "date" }, font: { family: "system-ui, sans-serif", size: 11 },
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
  };
  const config = { displayModeBar: false, responsive: true };
  let drawn = false;
  function draw() {
    drawn = true;
    for (const c of charts) {
      c.div = document.getElementById(c.id);
      c.index = new Map();
      c.last = new Map(); // trace name -> epoch seconds of its newest point
      // Until the first point: the last minute on the axis, not Plotly's year 2000.
      const now = Date.now();
      c.empty = true;
      Plotly.newPlot(c.div, [], { ...base, ...(c.layout || {}), title: { text: c.title, font: { size: 12 } },
        xaxis: { ...base.xaxis, range: [new Date(now - 60000), new Date(now)] },
        yaxis: { rangemode: "tozero", ...((c.layout || {}).yaxis || {}) } }, config);
    }
  }
  function add(samples, live) {
    // The page's stored samples are already the job's own; live ones are the cluster's.
    if (live) samples = samples.filter((s) => jobFilter === null || s.job === jobFilter);
    if (!samples.length) return;
    document.getElementById("metrics-empty").hidden = true;
    for (const c of charts) {
      const grouped = new Map();
      for (const s of samples) {
        const x = new Date(s.t * 1000);
        for (const [name, y] of c.traces(s)) {
          if (!grouped.has(name)) grouped.set(name, { x: [], y: [] });
          const trace = grouped.get(name);
          const last = c.last.get(name);
          if (last !== undefined && s.t - last > GAP_S) {
            trace.x.push(new Date((last + period) * 1000));
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
        Plotly.relayout(c.div, { "xaxis.autorange": true });
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
  function start() {
    const history = JSON.parse(document.getElementById("metrics-history").textContent || "[]");
    // Nothing stored and nothing to come: the note says so, no empty axes.
    if (!history.length && !box.dataset.ws) grid.style.display = "none";
    draw();
    add(history, false);
    if (box.dataset.ws) follow(box.dataset.ws);
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
    document.getElementById("metrics-note").textContent = "live, one point a second, last 10 minutes";
    const empty = document.getElementById("metrics-empty");
    empty.textContent = "Waiting for the first samples…";
    connect();
  }
  window.suanliMetrics = { follow };
  // A card that waits hidden for its job is drawn when it is shown (follow).
  if (!box.closest("[hidden]")) start();
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
