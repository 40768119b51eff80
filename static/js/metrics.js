// Live and stored utilisation charts: one Plotly chart per measure, a trace per node (and
// per GPU). Live pages extend the traces (Plotly.extendTraces) with a 10-minute window.
(function () {
  const box = document.getElementById("metrics");
  if (!box || typeof Plotly === "undefined") return;
  const WINDOW_S = 600;
  const jobFilter = box.dataset.job ? Number(box.dataset.job) : null;
  const rdma = box.dataset.rdma === "1";
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
  for (const c of charts) {
    c.div = document.getElementById(c.id);
    c.index = new Map();
    Plotly.newPlot(c.div, [], { ...base, ...(c.layout || {}), title: { text: c.title, font: { size: 12 } },
      yaxis: { rangemode: "tozero", ...((c.layout || {}).yaxis || {}) } }, config);
  }
  function add(samples, live) {
    samples = samples.filter((s) => jobFilter === null || s.job === jobFilter);
    if (!samples.length) return;
    document.getElementById("metrics-empty").hidden = true;
    for (const c of charts) {
      const grouped = new Map();
      for (const s of samples) {
        const x = new Date(s.t * 1000);
        for (const [name, y] of c.traces(s)) {
          if (!grouped.has(name)) grouped.set(name, { x: [], y: [] });
          grouped.get(name).x.push(x);
          grouped.get(name).y.push(y);
        }
      }
      const fresh = [...grouped.keys()].filter((n) => !c.index.has(n));
      if (fresh.length) {
        Plotly.addTraces(c.div, fresh.map((name) => ({ name, x: [], y: [], mode: "lines", line: { width: 1.5 } })));
        for (const name of fresh) c.index.set(name, c.index.size);
      }
      const names = [...grouped.keys()];
      Plotly.extendTraces(
        c.div,
        { x: names.map((n) => grouped.get(n).x), y: names.map((n) => grouped.get(n).y) },
        names.map((n) => c.index.get(n)),
        live ? WINDOW_S : undefined,
      );
    }
  }
  const history = JSON.parse(document.getElementById("metrics-history").textContent || "[]");
  add(history, Boolean(box.dataset.ws));
  if (!box.dataset.ws) return;
  let backoff = 1000;
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
  connect();
})();
