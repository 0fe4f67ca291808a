// Progressive enhancement for the dashboard. Every page works without this file; with it,
// the deployment timeline, benchmark progress and accelerator readings update in place.
// It only polls small JSON views of the dashboard with the session cookie.
(function () {
  "use strict";

  function getJSON(url) {
    return fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); });
  }

  function setText(root, field, text) {
    var el = root.querySelector('[data-field="' + field + '"]');
    if (el) { el.textContent = text; }
    return el;
  }

  // --- Deployment timeline -------------------------------------------------------------
  var ACTIVE_STATES = ["deploying", "stopping"];

  function watchTimeline(section) {
    var url = section.getAttribute("data-timeline");
    var last = parseInt(section.getAttribute("data-last-event") || "0", 10) || 0;
    var list = document.querySelector('[data-field="events"]');
    function tick() {
      getJSON(url + "?after=" + last).then(function (data) {
        data.events.forEach(function (e) {
          if (e.id <= last) { return; }
          last = e.id;
          var li = document.createElement("li");
          li.className = "level-" + e.level + " new";
          li.setAttribute("data-event", e.id);
          var time = document.createElement("time");
          time.setAttribute("datetime", e.created_at);
          time.textContent = e.time;
          var step = document.createElement("span");
          step.className = "step";
          step.textContent = "g" + e.generation + " · " + e.step;
          var msg = document.createElement("span");
          msg.className = "message";
          msg.textContent = e.message;
          li.append(time, " ", step, " ", msg);
          if (e.trace_id) {
            var trace = document.createElement(e.trace_url ? "a" : "span");
            trace.className = "trace";
            if (e.trace_url) {
              trace.href = e.trace_url;
              trace.rel = "noopener";
              trace.target = "_blank";
              trace.textContent = "trace " + e.trace_id.slice(0, 8);
            } else {
              trace.textContent = "trace " + e.trace_id;
            }
            li.append(" ", trace);
          }
          if (list) { list.appendChild(li); list.scrollTop = list.scrollHeight; }
        });
        section.setAttribute("data-last-event", String(last));
        section.setAttribute("data-state", data.state);
        var badge = setText(section, "state", data.state_label);
        if (badge) { badge.className = "badge state-" + data.state; }
        setText(section, "step", data.step ? "waiting on " + data.step : "");
        setText(section, "generation", String(data.generation));
        setText(section, "desired", data.desired_state);
        setText(section, "reason", data.state_reason);
        setText(document, "gpu-endpoint", data.gpu_endpoint || "-");
        setText(document, "cpu-endpoint", data.cpu_endpoint || "-");
        // Poll quickly while a workflow runs, slowly otherwise (a deploy may start elsewhere).
        var busy = ACTIVE_STATES.indexOf(data.state) >= 0;
        setTimeout(tick, busy ? 1000 : 5000);
      }).catch(function () { setTimeout(tick, 5000); });
    }
    setTimeout(tick, 500);
  }

  // --- Accelerator readings ------------------------------------------------------------
  function watchAccelerators(section) {
    var url = section.getAttribute("data-live-accelerators");
    function tick() {
      getJSON(url).then(function (data) {
        data.accelerators.forEach(function (a) {
          var row = section.querySelector('[data-acc="' + a.id + '"]');
          if (!row) { return; }
          setText(row, "util", a.utilization_percent.toFixed(1) + "%");
          setText(row, "mem", a.memory_used_gb.toFixed(1) + " GB / " + a.memory_total_gb.toFixed(1) + " GB");
          setText(row, "temp", a.temperature_c === null ? "-" : Math.round(a.temperature_c) + " °C");
          var um = row.querySelector('[data-field="util-meter"]');
          if (um) { um.value = a.utilization_percent; }
          var mm = row.querySelector('[data-field="mem-meter"]');
          if (mm) { mm.value = a.memory_percent; }
        });
        setTimeout(tick, 5000);
      }).catch(function () { setTimeout(tick, 15000); });
    }
    setTimeout(tick, 5000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-timeline]").forEach(watchTimeline);
    document.querySelectorAll("[data-live-accelerators]").forEach(watchAccelerators);
  });
})();
