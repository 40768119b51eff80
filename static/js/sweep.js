// The sweep page's charts (console/views_sweeps.py chart_data): the metric against the
// step, a line per trial (pruned ones dashed and faint, the best one thick), and the
// parallel coordinates of the trials' parameters and metric. The first draw reads the
// page's json_script; while the sweep runs, each htmx swap of #sweep-live (the poll)
// fetches data.json and redraws. Every word comes translated from the page (data-word-*).
(function () {
  const box = document.getElementById("sweep-curves");
  const parBox = document.getElementById("sweep-parcoords");
  if (!box || !parBox || typeof Plotly === "undefined") return;
  const words = box.dataset;
  const config = { displayModeBar: false, responsive: true };
  const font = { family: "inherit", size: 12 };

  function curveTraces(data) {
    return data.curves.filter((c) => c.steps.length).map((c) => {
      const pruned = c.state === "pruned";
      let name = words.wordTrial.replace("{n}", c.number);
      if (c.best) name += " · " + words.wordBest;
      else if (pruned) name += " · " + words.wordPruned;
      return {
        type: "scatter", mode: c.steps.length > 1 ? "lines" : "markers", name,
        x: c.steps, y: c.values,
        line: { width: c.best ? 4 : pruned ? 1.2 : 2, dash: pruned ? "dash" : "solid", color: c.best ? "#1f6feb" : undefined },
        opacity: pruned ? 0.45 : c.best ? 1 : 0.8,
        hovertemplate: "%{x}: %{y:.4g}<extra>" + name + "</extra>",
      };
    });
  }

  function drawCurves(data) {
    const traces = curveTraces(data);
    const layout = {
      margin: { l: 56, r: 12, t: 10, b: 40 }, height: 320, font, showlegend: true,
      legend: { orientation: "v", x: 1.02, y: 1 },
      xaxis: { title: { text: words.wordStep }, zeroline: false },
      yaxis: { title: { text: data.metric }, zeroline: false },
      annotations: traces.length ? [] : [{ text: words.wordEmpty, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }],
    };
    Plotly.react(box, traces, layout, config);
  }

  function drawParcoords(data) {
    const p = data.parcoords;
    if (!p.trials.length) {
      Plotly.react(parBox, [], {
        height: 120, margin: { l: 10, r: 10, t: 10, b: 10 }, xaxis: { visible: false }, yaxis: { visible: false },
        annotations: [{ text: words.wordEmpty, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }],
      }, config);
      return;
    }
    const dimensions = p.dimensions.map((d) => {
      const dim = { label: d.label, values: d.values };
      if (d.range && d.range[0] !== d.range[1]) dim.range = d.range;
      if (d.tickvals) { dim.tickvals = d.tickvals; dim.ticktext = d.ticktext; }
      return dim;
    });
    const trace = {
      type: "parcoords", dimensions,
      line: {
        color: p.color, colorscale: "Viridis", showscale: true,
        // The better end of the scale is the same colour whichever the direction.
        reversescale: data.direction === "minimize",
        colorbar: { title: { text: data.metric, side: "top" }, thickness: 12, x: 1.08 },
      },
      labelfont: font, tickfont: { size: 11 },
    };
    Plotly.react(parBox, [trace], { height: 360, margin: { l: 60, r: 110, t: 50, b: 20 }, font }, config);
  }

  function draw(data) {
    drawCurves(data);
    drawParcoords(data);
  }

  function first() {
    const source = document.getElementById(box.dataset.source);
    if (source) draw(JSON.parse(source.textContent));
  }

  // An outerHTML swap settles on the new #sweep-live, so that is the event's target.
  document.body.addEventListener("htmx:afterSettle", (event) => {
    if (!event.target || event.target.id !== "sweep-live") return;
    fetch(box.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then((r) => (r.ok ? r.json() : null))
      .then((data) => { if (data) draw(data); })
      .catch(() => {});
  });
  if (document.readyState === "complete") first();
  else window.addEventListener("load", first);
})();
