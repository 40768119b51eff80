// The "acting for" switcher (templates/_acting_switch.html): choosing sends it at once; its
// button stays for browsers without scripts.
document.addEventListener("change", (event) => {
  const select = event.target.closest(".actingswitch select");
  if (select) select.form.requestSubmit ? select.form.requestSubmit() : select.form.submit();
});
document.querySelectorAll(".actingswitch .actinggo").forEach((button) => { button.hidden = true; });
