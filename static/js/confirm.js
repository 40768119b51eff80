// A form with data-confirm asks before it is sent; the question comes translated from the
// page (templates), so no words live here.
document.addEventListener("submit", (event) => {
  const question = event.target.dataset && event.target.dataset.confirm;
  if (question && !window.confirm(question)) event.preventDefault();
}, true);
