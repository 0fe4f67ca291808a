// The playground (templates/dashboard/_playground.html): posts its form with the CSRF token
// and shows the JSON answer in place. Without this file the form posts and the answer comes
// back as a message on the page.
(function () {
  "use strict";

  function show(root, field, text) {
    var el = root.querySelector('[data-field="' + field + '"]');
    if (el) { el.textContent = text; }
  }

  function watchPlayground(form) {
    var section = form.closest("section");
    var result = section.querySelector('[data-field="playground-result"]');
    var errorBox = section.querySelector('[data-field="play-error"]');
    var button = form.querySelector('button[type="submit"]');
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      var data = new FormData(form);
      button.disabled = true;
      button.textContent = "Sending…";
      fetch(form.action, {
        method: "POST",
        body: data,
        credentials: "same-origin",
        headers: { Accept: "application/json", "X-CSRFToken": data.get("csrfmiddlewaretoken") },
      }).then(function (r) {
        return r.json().catch(function () { return { ok: false, error: "HTTP " + r.status }; });
      }).then(function (a) {
        result.hidden = false;
        var problems = [];
        if (a.errors) {
          Object.keys(a.errors).forEach(function (k) { problems.push(k + ": " + a.errors[k].join(" ")); });
        }
        var message = problems.length ? problems.join("; ") : (a.error || "");
        errorBox.hidden = !message;
        errorBox.textContent = message;
        show(section, "play-route", a.route || "-");
        show(section, "play-reason", a.reason || "-");
        show(section, "play-ttft", a.ttft_ms === null || a.ttft_ms === undefined ? "-" : a.ttft_ms + " ms");
        show(section, "play-tps", a.tokens_per_second === null || a.tokens_per_second === undefined ? "-" : a.tokens_per_second + " tokens/s");
        show(section, "play-tokens", a.completion_tokens === null || a.completion_tokens === undefined ? "-" : String(a.completion_tokens));
        show(section, "play-router", a.router || "-");
        show(section, "play-text", a.text || "");
      }).catch(function () {
        result.hidden = false;
        errorBox.hidden = false;
        errorBox.textContent = "the control plane did not answer";
      }).then(function () {
        button.disabled = false;
        button.textContent = "Send";
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form[data-playground]").forEach(watchPlayground);
  });
})();
