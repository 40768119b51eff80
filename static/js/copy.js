// A button with data-copy copies the text of the element just before it (a login command,
// a join command, an invitation link); its words come from the page (translated): its own
// text, and data-copied. On plain http the text is selected instead, for Ctrl+C. Listening
// on the document keeps buttons that a status poll swaps in later working.
document.addEventListener("click", function (event) {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const code = button.previousElementSibling;
  if (!button.dataset.label) button.dataset.label = button.textContent;
  const done = function () {
    button.textContent = button.dataset.copied;
    setTimeout(function () { button.textContent = button.dataset.label; }, 1500);
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(code.textContent).then(done);
  } else {
    const range = document.createRange();
    range.selectNodeContents(code);
    window.getSelection().removeAllRanges();
    window.getSelection().addRange(range);
    if (document.execCommand("copy")) done();
  }
});
