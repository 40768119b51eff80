// The job page's Profile section (loaded and refreshed by htmx): draw each chart whose
// figure the server sent as JSON (`data-plotly-json` names the json_script element).
(function () {
  function draw(root) {
    if (!window.Plotly) return;
    (root || document).querySelectorAll("[data-plotly-json]").forEach((box) => {
      if (box.dataset.drawn) return;
      const source = document.getElementById(box.dataset.plotlyJson);
      if (!source) return;
      const fig = JSON.parse(JSON.parse(source.textContent));
      box.dataset.drawn = "1";
      Plotly.newPlot(box, fig.data, fig.layout, {displayModeBar: false, responsive: true});
    });
  }
  window.addEventListener("load", () => draw());
  document.addEventListener("htmx:afterSettle", () => draw());
})();
