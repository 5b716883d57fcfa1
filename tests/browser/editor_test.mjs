// Drives the real ComfyUI editor (the frontend ComfyUI 0.33 pins, 1.49) in Debian's headless Chromium against a
// ComfyUI server with FluxAccel on 127.0.0.1. Run by tests/e2e/test_browser.py, which asserts on the JSON this
// prints last. Env: COMFY_URL, E2E_UNET (a FLUX file the server's UNETLoader lists), ARTIFACTS (screenshots),
// CHROMIUM (default /usr/bin/chromium).
import { chromium } from "playwright-core";

const url = process.env.COMFY_URL;
const out = process.env.ARTIFACTS;
const unet = process.env.E2E_UNET;
const result = { consoleErrors: [] };
const step = (msg) => console.error(`[browser] ${msg}`);

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
  page.on("console", (m) => m.type() === "error" && result.consoleErrors.push(m.text()));
  page.on("pageerror", (e) => result.consoleErrors.push(String(e)));
  step(`open ${url}`);
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && window.__fluxaccel, null, { timeout: 180000 });
  await page.waitForTimeout(1500);

  // 1. the example workflow, from the editor's template browser (the plugin's example_workflows/)
  step("templates");
  const templates = page.getByText("All Templates").first();
  if (!(await templates.isVisible())) await page.getByText("Templates", { exact: true }).first().click();
  await templates.waitFor({ timeout: 30000 });
  await page.locator("[role=dialog]").getByText("comfyui-fluxaccel").first().click();
  await page.waitForTimeout(1000);
  result.templateCards = await page.locator("[role=dialog]").innerText();
  await page.screenshot({ path: `${out}/templates.png` });
  // every card shows its picture (example_workflows/<name>.jpg, what the frontend asks for)
  await page.waitForTimeout(1500);
  result.cardImages = await page.evaluate(() => [...document.querySelectorAll("img")]
    .filter((img) => img.src.includes("fluxaccel") && img.src.includes(".jpg"))
    .map((img) => ({ src: img.src.split("/").pop(), loaded: img.complete && img.naturalWidth > 0 })));
  await page.locator("[role=dialog]").getByText("fluxaccel_quickstart_cpu", { exact: true }).first().click();
  await page.waitForFunction(() => window.app.graph._nodes.some((n) => n.type === "FluxAccelBenchmark"), null,
    { timeout: 30000 });
  await page.waitForTimeout(1000);
  result.benchmarkWidgets = await page.evaluate(() => Object.fromEntries(
    window.app.graph._nodes.find((n) => n.type === "FluxAccelBenchmark").widgets.map((w) => [w.name, w.value])));
  result.shippedSizes = await page.evaluate(() => Object.fromEntries(
    window.app.graph._nodes.map((n) => [n.type, [...n.size]])));

  // 2. the node search finds our nodes, and they sit in the FluxAccel category
  step("node search");
  result.categories = await page.evaluate(() => Object.fromEntries(
    Object.entries(window.LiteGraph.registered_node_types)
      .filter(([k]) => k.startsWith("FluxAccel")).map(([k, v]) => [k, v.category])));
  // a double click on empty canvas opens the search box; on a loaded machine it can take a while to appear, or a
  // late dialog can swallow the click, so wait for the box itself and try again (Escape closes whatever is open)
  // the search box: an input above the #results-list listbox (the older frontends' box is matched too)
  const searchInput = page.locator(
    ".comfy-vue-node-search-container input, [role=dialog]:has(#results-list) input, input[aria-controls=results-list]",
  ).first();
  // an empty part of the canvas under the click: the view moved away from the loaded nodes (restored below)
  await page.evaluate(() => {
    window.__fluxaccelView = [...window.app.canvas.ds.offset];
    window.app.canvas.ds.offset = [-20000, -20000];
    window.app.graph.setDirtyCanvas(true, true);
  });
  for (let attempt = 1; attempt <= 4 && !(await searchInput.isVisible()); attempt++) {
    await page.keyboard.press("Escape");
    await page.locator("#graph-canvas").dblclick({ position: { x: 1100, y: 600 } });
    await searchInput.waitFor({ state: "visible", timeout: 15000 }).catch(() => step(`search box: attempt ${attempt}`));
  }
  await searchInput.fill("FluxAccel");
  const ourTitles = ["Quantize FP8 (FluxAccel)", "Compile + CUDA Graph (FluxAccel)", "Warmup (FluxAccel)",
    "Benchmark (FluxAccel)"];
  await page.waitForFunction((titles) => {
    const text = [...document.querySelectorAll("[role=option]")].map((o) => o.innerText.replace(/\s+/g, " ")).join("\n");
    return titles.every((t) => text.includes(t));
  }, ourTitles, { timeout: 60000, polling: 500 }).catch(() => step("search results: not all of our nodes listed"));
  result.searchResults = await page.locator("[role=option]:visible").allInnerTexts();
  result.openDialogs = await page.locator("[role=dialog]:visible").allInnerTexts();
  await page.screenshot({ path: `${out}/node-search.png` });
  await page.keyboard.press("Escape");
  await page.evaluate(() => { window.app.canvas.ds.offset = window.__fluxaccelView; });
  await page.waitForTimeout(500);

  // 3. the CPU quickstart as the template browser loaded it, for the run (today's widgets: not migrated)
  result.shippedCompile = await page.evaluate(async () => {
    const data = await (await fetch("/api/workflow_templates/comfyui-fluxaccel/fluxaccel_quickstart_cpu.json")).json();
    const loaded = window.app.graph._nodes.find((n) => n.type === "FluxAccelCompile");
    return { widgets: Object.fromEntries(loaded.widgets.map((w) => [w.name, w.value])),
             saved: data.nodes.find((n) => n.type === "FluxAccelCompile").widgets_values,
             migrated: window.__fluxaccel.migrated || 0 };
  });
  await page.waitForTimeout(800);
  result.loadedTypes = await page.evaluate(() => window.app.graph._nodes.map((n) => n.type).sort());

  // 4. queue it as shipped: Compile -> Warmup -> Benchmark on the tiny model
  step("queue the workflow");
  await page.evaluate(() => window.app.queuePrompt(0, 1));
  await page.waitForSelector(".fluxaccel-table table tbody tr", { timeout: 600000 });
  await page.waitForTimeout(1000);
  // the Benchmark's results as the page shows them: an HTML table (headings, cells, the best cells marked), and the
  // markdown its copy button hands over
  result.table = await page.evaluate(() => {
    const t = document.querySelector(".fluxaccel-table table");
    const r = t.getBoundingClientRect();
    const box = t.closest(".fluxaccel-table").getBoundingClientRect();
    const ths = [...t.tHead.rows[0].cells];
    return {
      // at the node's shipped size: the key columns lie inside the node, the others are behind "All columns"
      shownHeadings: ths.filter((c) => getComputedStyle(c).display !== "none").map((c) => c.textContent),
      shownInside: ths.filter((c) => getComputedStyle(c).display !== "none")
        .every((c) => { const q = c.getBoundingClientRect(); return q.width > 0 && q.right <= box.right + 1; }),
      notes: t.closest(".fluxaccel-table").querySelector(".notes")?.textContent ?? "",
      headings: [...t.tHead.rows[0].cells].map((c) => c.textContent),
      rows: [...t.tBodies[0].rows].map((tr) => [...tr.cells].map((c) => c.textContent)),
      best: [...t.querySelectorAll("td.best")].map((c) => c.textContent),
      caption: t.caption?.textContent ?? "",
      visible: r.width > 100 && r.height > 40,
    };
  });
  await page.click(".fluxaccel-table button.fluxaccel-copy");
  result.copied = await page.evaluate(() => window.__fluxaccel.copied.at(-1) ?? "");
  // the text as the frontend draws it: our entry among the Compile node's node badges
  result.badge = await page.evaluate(() => {
    const n = window.app.graph._nodes.find((x) => x.type === "FluxAccelCompile");
    const ours = (n?.badges || []).map((b) => (typeof b === "function" ? b() : b)).find((b) => b?.fluxaccel);
    return ours?.text ?? null;
  });
  // the Compile node's own text (its report area), from the same state as the badge
  result.compileText = await page.evaluate(() => {
    const n = window.app.graph._nodes.find((x) => x.type === "FluxAccelCompile");
    return n?.widgets?.find((w) => w.name === "fluxaccel_report")?.element?.value ?? "";
  });
  // the minimap would cover the Benchmark's chart in the screenshot (a user's setting, off here only)
  await page.evaluate(async () => {
    try { await window.app.extensionManager?.setting?.set("Comfy.Minimap.Visible", false); } catch {}
  });
  await page.evaluate(() => {
    // frame the whole graph at its shipped node sizes for the screenshot (the README shows it)
    const ns = window.app.graph._nodes;
    const x0 = Math.min(...ns.map((n) => n.pos[0])), y0 = Math.min(...ns.map((n) => n.pos[1])) - 40;
    const x1 = Math.max(...ns.map((n) => n.pos[0] + n.size[0])), y1 = Math.max(...ns.map((n) => n.pos[1] + n.size[1]));
    const scale = Math.min(1440 / (x1 - x0), 900 / (y1 - y0), 1);
    window.app.canvas.ds.scale = scale;
    window.app.canvas.ds.offset = [110 / scale - x0, 70 / scale - y0];
    window.app.graph.setDirtyCanvas(true, true);
  });
  await page.waitForTimeout(800);
  // the workflow tabs open in the screenshot: the shipped template's alone
  result.openTabs = await page.evaluate(() => {
    const open = window.app.extensionManager?.workflow?.openWorkflows;
    return Array.isArray(open) ? open.map((w) => w.filename ?? w.path ?? String(w)) : null;
  });
  await page.screenshot({ path: `${out}/editor-after-run.png` });

  // 5. a resolution the compiled model was not compiled for, with resolution_policy set to strict (a fleet's
  // choice; the default compiles the new size): a toast names both shapes
  step("wrong resolution");
  await page.evaluate(() => {
    const c = window.app.graph._nodes.find((n) => n.type === "FluxAccelCompile");
    c.widgets.find((x) => x.name === "resolution_policy").value = "strict";
    const b = window.app.graph._nodes.find((n) => n.type === "FluxAccelBenchmark");
    for (const name of ["width", "height"]) b.widgets.find((x) => x.name === name).value = 80;
  });
  await page.evaluate(() => window.app.queuePrompt(0, 1));
  await page.waitForFunction(() => window.__fluxaccel.toasts.length > 0, null, { timeout: 300000, polling: 500 });
  result.toasts = await page.evaluate(() => window.__fluxaccel.toasts);
  await page.waitForTimeout(800);
  result.toastDom = await page.locator(".p-toast-message").allInnerTexts();
  await page.screenshot({ path: `${out}/editor-toast.png` });
  // 6. every template as loaded (the frontend may enlarge a node it finds too small): no two nodes overlap; after
  // the run, so that its screenshot shows the shipped template alone
  step("template layouts");
  result.overlaps = await page.evaluate(async () => {
    const names = await (await fetch("/workflow_templates")).json();
    const out = {};
    for (const name of names["comfyui-fluxaccel"] || []) {
      const data = await (await fetch(`/api/workflow_templates/comfyui-fluxaccel/${name}.json`)).json();
      await window.app.loadGraphData(data, true, false, name);
      await new Promise((r) => setTimeout(r, 300));
      const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
      const rects = window.app.graph._nodes.map((n) => ({ id: n.id, x: n.pos[0], y: n.pos[1] - title,
        w: n.size[0], h: n.size[1] + title }));
      const bad = [];
      for (let i = 0; i < rects.length; i++) for (let j = i + 1; j < rects.length; j++) {
        const a = rects[i], b = rects[j];
        if (a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h) bad.push([a.id, b.id]);
      }
      out[name] = bad;
    }
    return out;
  });
  // workflows saved when Compile had twelve widgets (cuda_graphs first) and when it still had clear_cache (seven):
  // the values land on today's widgets by name
  step("old Compile widgets");
  result.oldCompile = await page.evaluate(async () => {
    const loadWith = async (values) => {
      const data = await (await fetch("/api/workflow_templates/comfyui-fluxaccel/fluxaccel_quickstart_cpu.json")).json();
      data.nodes.find((n) => n.type === "FluxAccelCompile").widgets_values = values;
      await window.app.loadGraphData(data, true, false, "old-compile");
      await new Promise((r) => setTimeout(r, 300));
      const loaded = window.app.graph._nodes.find((n) => n.type === "FluxAccelCompile");
      return Object.fromEntries(loaded.widgets.map((w) => [w.name, w.value]));
    };
    const migratedBefore = window.__fluxaccel.migrated || 0;
    const twelve = await loadWith([true, "tuned-kernels", "recompile", 3, true, true, "fp8", true, "fluxaccel",
                                   "auto", true, "auto"]);
    const seven = await loadWith([true, "default", "recompile", 2, true, true, true]);
    return { twelve, seven, migrated: (window.__fluxaccel.migrated || 0) - migratedBefore };
  });
} catch (e) {
  result.error = String(e?.stack || e);
} finally {
  await browser.close();
}
console.log("RESULT " + JSON.stringify(result));
