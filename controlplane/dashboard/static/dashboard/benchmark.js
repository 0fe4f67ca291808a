// A benchmark run's page as the run goes: it polls the run's progress JSON every two
// seconds, shows the phase, points and ETA, swaps in the charts each time a point finishes,
// and cancels without a reload. The banner, badge and Cancel button all follow the one
// state the JSON names. Without this file the page shows the same things on a reload.
(function () {
  "use strict";

  var POLL_MS = 2000;

  function field(root, name) { return root.querySelector('[data-field="' + name + '"]'); }
  function setText(root, name, text) {
    var el = field(root, name);
    if (el) { el.textContent = text; }
    return el;
  }

  function watch(section) {
    var url = section.getAttribute("data-bench-run");
    var chartsUrl = section.getAttribute("data-run-charts");
    var points = parseInt(section.getAttribute("data-points") || "0", 10) || 0;
    var timer = null;

    function swapCharts() {
      return fetch(chartsUrl, { credentials: "same-origin" })
        .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
        .then(function (html) {
          var holder = document.querySelector('[data-field="charts"]');
          if (holder) { holder.innerHTML = html; }
        });
    }

    function show(data) {
      section.setAttribute("data-state", data.state);
      section.setAttribute("data-active", data.active ? "1" : "0");
      setText(section, "banner", data.banner);
      var badge = setText(section, "status", data.state);
      if (badge) { badge.className = "badge state-" + data.state; }
      var bar = field(section, "progress");
      if (bar) { bar.value = data.progress; bar.textContent = data.percent; }
      setText(section, "percent", data.percent);
      setText(section, "points", data.points_done + " of " + data.points_total + " points");
      setText(section, "eta", data.eta ? data.eta : "");
      setText(section, "phase", data.phase || "-");
      setText(section, "error", data.error || "");
      var cancel = field(section, "cancel");
      if (cancel) { cancel.hidden = !data.cancellable; }
      var changed = data.points_done !== points;
      points = data.points_done;
      section.setAttribute("data-points", String(points));
      return changed;
    }

    function tick() {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); })
        .then(function (data) {
          var changed = show(data);
          if (changed || !data.active) { swapCharts().catch(function () {}); }
          if (data.active) { timer = setTimeout(tick, POLL_MS); }
        })
        .catch(function () { timer = setTimeout(tick, POLL_MS * 3); });
    }

    var form = field(section, "cancel");
    if (form) {
      form.addEventListener("submit", function (event) {
        event.preventDefault();
        var button = form.querySelector("button");
        if (button) { button.disabled = true; }
        fetch(form.action, {
          method: "POST",
          credentials: "same-origin",
          headers: { Accept: "application/json" },
          body: new FormData(form),
        })
          .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); })
          .then(function (data) {
            show(data);
            if (button) { button.disabled = false; }
            if (timer) { clearTimeout(timer); }
            timer = setTimeout(tick, data.active ? 500 : 0);
          })
          .catch(function () { if (button) { button.disabled = false; } });
      });
    }

    if (section.getAttribute("data-active") === "1") { timer = setTimeout(tick, POLL_MS); }
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-bench-run]").forEach(watch);
  });
})();
