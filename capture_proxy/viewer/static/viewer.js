// The chain viewer's only script: a tooltip for token spans (position, id, log prob, weight
// version).
// Server-rendered pages work without it; no external resources.
"use strict";
(function () {
  const tip = document.getElementById("tip");
  if (!tip) return;
  const roles = {
    "r-context": "context",
    "r-ancestor": "generated earlier",
    "r-interstitial": "interstitial",
    "r-generation": "generated",
  };
  function describe(el) {
    const lines = ["position " + el.dataset.p, "id " + el.dataset.i];
    if (el.dataset.lp !== undefined) {
      lines.push("log prob " + el.dataset.lp + "  (p " + Math.exp(Number(el.dataset.lp)).toFixed(3) + ")");
    } else if (el.classList.contains("b5")) {
      lines.push("log prob non-finite");
    }
    for (const cls in roles) if (el.classList.contains(cls)) lines.push(roles[cls]);
    if (el.dataset.wv !== undefined) lines.push("weight version " + el.dataset.wv);
    if (el.classList.contains("xr")) lines.push("routed experts: row");
    if (el.classList.contains("xm")) lines.push("routed experts: no row");
    return lines.join("\n");
  }
  document.addEventListener("mouseover", function (ev) {
    const el = ev.target instanceof Element ? ev.target.closest(".t[data-p]") : null;
    if (!el) { tip.hidden = true; return; }
    tip.textContent = describe(el);
    tip.hidden = false;
    const r = el.getBoundingClientRect();
    tip.style.left = Math.min(r.left, window.innerWidth - 260) + "px";
    tip.style.top = (r.bottom + 6) + "px";
  });
})();
