// The live serving panel (templates/dashboard/_serving_panel.html): polls its JSON view and
// swaps in the panel's body, rendered by the server from the same figures; the window links
// switch the window in place. Without this file the links reload the page with ?window=.
(function () {
  "use strict";

  function watchServing(panel) {
    var base = panel.getAttribute("data-live-serving");
    var windowKey = panel.getAttribute("data-window");
    var poll = parseInt(panel.getAttribute("data-poll") || "5", 10) || 5;
    var body = panel.querySelector('[data-field="serving-body"]');
    var status = panel.querySelector('[data-field="serving-status"]');
    var timer = null;
    var updates = 0;

    function schedule(seconds) {
      if (timer !== null) { clearTimeout(timer); }
      timer = setTimeout(tick, seconds * 1000);
    }

    function tick() {
      var url = base + (base.indexOf("?") >= 0 ? "&" : "?") + "window=" + encodeURIComponent(windowKey);
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); })
        .then(function (data) {
          if (data.window !== windowKey) { return; }  // an answer for a window left since
          if (body) { body.innerHTML = data.html; }
          poll = data.poll_seconds || poll;
          updates += 1;
          panel.setAttribute("data-updates", String(updates));
          if (status) {
            status.textContent = "Figures of the last " + data.window_label + ", updated " +
              new Date().toLocaleTimeString() + ";";
          }
          schedule(poll);
        })
        .catch(function () { schedule(Math.max(poll, 15)); });
    }

    panel.querySelectorAll("[data-window-key]").forEach(function (link) {
      link.addEventListener("click", function (event) {
        event.preventDefault();
        windowKey = link.getAttribute("data-window-key");
        panel.setAttribute("data-window", windowKey);
        panel.querySelectorAll("[data-window-key]").forEach(function (other) {
          if (other === link) { other.setAttribute("aria-current", "true"); }
          else { other.removeAttribute("aria-current"); }
        });
        if (window.history && window.history.replaceState) {
          var params = new URLSearchParams(window.location.search);
          params.set("window", windowKey);
          window.history.replaceState(null, "", "?" + params.toString());
        }
        tick();
      });
    });
    schedule(poll);
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live-serving]").forEach(watchServing);
  });
})();
