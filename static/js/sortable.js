// Tables marked data-sortable sort by a column when its heading's button is pressed
// (templates/console/_key_averages.html). A cell's data-value is its number (a time in
// microseconds, bytes, a percentage, a count); a column sorts by those, cells without one
// last, or else by its text. A number column sorts largest first, a text column A to Z; the
// same heading again reverses. aria-sort says which column sorts and which way. Bound on
// load and after htmx swaps a section in; a table is bound once. No words live here.
(function () {
  function key(row, index) {
    const cell = row.cells[index];
    const raw = cell && cell.dataset.value;
    const number = raw === undefined || raw === "" ? NaN : Number(raw);
    return { number, text: cell ? cell.textContent.trim() : "" };
  }

  function numeric(rows, index) {
    return rows.some((row) => !Number.isNaN(key(row, index).number));
  }

  function compare(a, b, byNumber, sign) {
    if (!byNumber) return sign * a.text.localeCompare(b.text);
    const aMissing = Number.isNaN(a.number);
    const bMissing = Number.isNaN(b.number);
    if (aMissing || bMissing) return aMissing - bMissing; // without a value: last, either way
    return sign * (a.number - b.number);
  }

  function sortBy(table, th) {
    const body = table.tBodies[0];
    if (!body) return;
    const index = th.cellIndex;
    const rows = Array.from(body.rows);
    const byNumber = numeric(rows, index);
    const first = byNumber ? "descending" : "ascending";
    const current = th.getAttribute("aria-sort");
    const order = current === first ? (first === "descending" ? "ascending" : "descending") : first;
    const sign = order === "ascending" ? 1 : -1;
    const keyed = rows.map((row, position) => ({ row, position, key: key(row, index) }));
    keyed.sort((a, b) => compare(a.key, b.key, byNumber, sign) || a.position - b.position);
    keyed.forEach((item) => body.appendChild(item.row));
    table.querySelectorAll("th[aria-sort]").forEach((other) => other.removeAttribute("aria-sort"));
    th.setAttribute("aria-sort", order);
  }

  function bind(table) {
    if (table.dataset.sortableBound) return;
    table.dataset.sortableBound = "1";
    table.addEventListener("click", (event) => {
      const button = event.target.closest("th button");
      if (!button || !table.contains(button)) return;
      sortBy(table, button.closest("th"));
    });
  }

  function bindAll() {
    document.querySelectorAll("table[data-sortable]").forEach(bind);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", bindAll);
  else bindAll();
  document.addEventListener("htmx:afterSettle", bindAll);
})();
