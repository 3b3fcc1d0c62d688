"""The report page rendered by headless Chromium: every plot decodes to an image with a size,
and every section is there. Skips where Chromium is not installed (the Makefile's setup installs
the Debian packages `chromium chromium-driver` where it runs as root with apt-get)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from actloop.monitor.report import PLOTS, build_report

from .test_report import fake_run

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)

# Runs after the page has loaded: writes what the browser decoded into the DOM, which
# --dump-dom then prints.
PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images].map(i => ({id: i.id, w: i.naturalWidth, h: i.naturalHeight, ok: i.complete}));
  const sections = [...document.querySelectorAll('section')].map(s => s.id);
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({imgs, sections, title: document.title});
  document.body.appendChild(out);
});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium chromium-driver)")
def test_report_renders_in_headless_chromium(cfg, tmp_path):
    page = build_report(fake_run(cfg, tmp_path / "run"))
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--user-data-dir=" + str(tmp_path / "profile"), "--virtual-time-budget=10000",
           "--dump-dom", probed.as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r"<pre id=\"probe\">(.*?)</pre>", res.stdout, re.S)
    assert m, f"no probe output; rc={res.returncode} stderr={res.stderr[-2000:]}"
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert probe["sections"] == ["summary", "plots", "alarms", "samples", "config"]
    assert sorted(i["id"] for i in probe["imgs"]) == sorted(f"plot-{n}" for n in PLOTS)
    for img in probe["imgs"]:
        assert img["ok"] and img["w"] == 700 and img["h"] == 360, img  # 7 x 3.6 inches at 100 dpi
    assert probe["title"] == "actloop report: run"
