// The drawing components shared by the scheduling simulator's page and the live dashboard:
// one view of slots, the KV pool, the queue and a step's rows, whatever engine feeds it.
// Plain functions over plain data; every colour comes from the caller's `colorOf(requestId)`.
"use strict";

const KVView = (() => {
  const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948",
                   "#76b7b2", "#9c755f", "#ff9da7"];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "style") node.style.cssText = value;
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function pale(hex) {
    const n = parseInt(hex.slice(1), 16);
    const mix = (c) => Math.round(c + (255 - c) * 0.72);
    return `rgb(${mix(n >> 16)}, ${mix((n >> 8) & 255)}, ${mix(n & 255)})`;
  }

  // A stable colour per id for an open-ended set of requests (the live engine): the palette
  // by order of first sight, then hues spread by the golden ratio.
  function colorAllocator() {
    const colors = new Map();
    return (id) => {
      if (!colors.has(id)) {
        const index = colors.size;
        if (index < PALETTE.length) colors.set(id, PALETTE[index]);
        else {
          const hue = Math.round(((index * 0.618034) % 1) * 360);
          colors.set(id, hslHex(hue, 0.6, 0.45));
        }
      }
      return colors.get(id);
    };
  }

  function hslHex(hue, s, l) {
    const k = (n) => (n + hue / 30) % 12;
    const a = s * Math.min(l, 1 - l);
    const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
    return "#" + [f(0), f(8), f(4)].map((x) => Math.round(x * 255).toString(16).padStart(2, "0")).join("");
  }

  // How an id is written on the page; a page with long ids (the live engine's) shortens it.
  const view = { label: (id) => id };

  function chip(requestId, color, extra) {
    return el("span", { class: "chip", "data-request": requestId, style: `background:${color}`,
                        title: requestId, text: view.label(requestId) + (extra || "") });
  }

  function list(ids) {
    return ids.length ? ids.map((id) => view.label(id)).join(", ") : "";
  }

  // queued: [{request_id, reason (a short key), why (its sentence), wait (text or ""),
  // preempted (a preempted request waiting to resume, first in line)}]
  function drawQueue(box, textBox, queued, colorOf) {
    box.replaceChildren();
    textBox.replaceChildren();
    if (!queued.length) {
      box.append(el("span", { class: "empty-note", text: "nobody waits" }));
      return;
    }
    const groups = new Map();
    for (const q of queued) {
      const node = chip(q.request_id, colorOf(q.request_id), q.wait ? ` ${q.wait}` : "");
      node.classList.add("queued");
      if (q.preempted) {
        node.classList.add("preempted");
        node.dataset.preempted = "true";
      }
      node.dataset.request = q.request_id;
      node.title = q.why || "";
      box.append(node);
      if (!groups.has(q.why)) groups.set(q.why, []);
      groups.get(q.why).push(q.request_id);
    }
    textBox.textContent = [...groups].filter(([why]) => why)
      .map(([why, ids]) => `${list(ids)}: ${why}`).join("; ");
  }

  // slots: one entry per slot, null when free, else {request_id, num_prompt_tokens,
  // num_computed, num_output, answer_length, returned, stalled, phase, num_preemptions}
  function drawSlots(box, slots, colorOf) {
    box.replaceChildren();
    slots.forEach((slot, index) => {
      const body = el("div", { class: "slot-body" });
      const row = el("div", { class: "slot", "data-slot": String(index),
                              "data-request": slot ? slot.request_id : "" },
                     el("div", { class: "slot-name", text: `slot ${index}` }), body);
      if (!slot) {
        body.append(el("span", { class: "empty-note", text: "free" }));
        box.append(row);
        return;
      }
      const color = colorOf(slot.request_id);
      const prompt = Math.min(slot.num_computed, slot.num_prompt_tokens);
      body.append(chip(slot.request_id, color), ` prompt ${prompt}/${slot.num_prompt_tokens}` +
                  ` \u00b7 answer ${slot.num_output}/${slot.answer_length}`);
      const total = Math.max(1, slot.num_prompt_tokens + slot.answer_length);
      body.append(el("div", { class: "bar" },
        el("span", { style: `width:${100 * prompt / total}%;background:${pale(color)}` }),
        el("span", { style: `width:${100 * slot.num_output / total}%;background:${color}` })));
      if (slot.num_preemptions) {
        body.append(el("span", { class: "preempt-note",
                                 text: ` preempted ${slot.num_preemptions}\u00d7` }));
        row.dataset.preemptions = String(slot.num_preemptions);
      }
      if (slot.phase) row.dataset.phase = slot.phase;
      if (slot.returned) row.classList.add("returned");
      if (slot.stalled) row.classList.add("is-stalled");
      box.append(row);
    });
  }

  // blocks: [{owner (id or ""), fill (positions written), refcount, cached, growth}]; a block
  // with refcount > 1 is shared by several owners, a cached one keeps a prefix nobody holds, a
  // growth one was taken by its owner after admission (beyond what admission reserved).
  function drawPool(box, blocks, blockSize, colorOf) {
    box.replaceChildren();
    const perCell = Math.max(1, Math.ceil(blockSize / 16));  // at most 16 cells a block
    const numCells = Math.ceil(blockSize / perCell);
    blocks.forEach((block, blockId) => {
      const owner = block.owner;
      const cells = el("div", { class: "cells", style: `grid-template-columns: repeat(${numCells}, 1fr)` });
      for (let c = 0; c < numCells; c++) {
        const cell = el("div", { class: "cell" });
        if (owner) cell.style.background = c * perCell < block.fill ? colorOf(owner) : pale(colorOf(owner));
        cells.append(cell);
      }
      const classes = ["block"];
      if (!owner) classes.push(block.cached ? "cached" : "free");
      if ((block.refcount || 0) > 1) classes.push("shared");
      if (owner && block.growth) classes.push("growth");
      let title = owner ? `block ${blockId}: ${owner}, ${block.fill} positions written` : `block ${blockId}: free`;
      if ((block.refcount || 0) > 1) title += `, shared by ${block.refcount}`;
      if (owner && block.growth) title += ", taken as it grew (not reserved at admission)";
      if (block.cached) title = `block ${blockId}: cached prefix, free to reuse`;
      const label = owner ? `${blockId} ${view.label(owner)}` : `${blockId}`;
      const node = el("div", { class: classes.join(" "), "data-block": String(blockId),
                               "data-owner": owner || "", "data-fill": String(block.fill), title },
                      cells, el("div", { class: "label", text: label }));
      if ((block.refcount || 0) > 1) node.dataset.refcount = String(block.refcount);
      if (block.cached) node.dataset.cached = "true";
      if (owner && block.growth) node.dataset.growth = "true";
      box.append(node);
    });
  }

  // -- the pool as typed arrays, for pools too large for a tile per block ----------------------
  //
  // An occupancy: {num_blocks, block_size, owners: [id...], owner: Int32Array (index into
  // owners, -1 when nobody holds the block), fill: Uint32Array (positions written), flags:
  // Uint8Array (SHARED | GROWTH | CACHED)}.
  const SHARED = 1, GROWTH = 2, CACHED = 4;
  const TILE_LIMIT = 2048;  // up to this many blocks, one tile per block (with its hover text)
  const MAP_HEIGHT = 320;   // the compact map's most pixels high
  const FREE_RGB = [238, 240, 243], CACHED_RGB = [185, 208, 232], SHARED_RGB = [29, 36, 48];

  function rgbOf(color) {
    if (color[0] === "#") {
      const n = parseInt(color.slice(1), 16);
      return [n >> 16, (n >> 8) & 255, n & 255];
    }
    return color.match(/\d+/g).slice(0, 3).map(Number);
  }
  const paleRgb = (rgb) => rgb.map((c) => Math.round(c + (255 - c) * 0.72));
  const darkRgb = (rgb) => rgb.map((c) => Math.round(c * 0.55));
  const css = (rgb) => `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;

  // The per-block objects drawPool draws, from an occupancy (a small pool's).
  function blocksOf(occ) {
    return Array.from({ length: occ.num_blocks }, (_, b) => {
      const holder = occ.owner[b];
      return { owner: holder >= 0 ? occ.owners[holder] : "", fill: occ.fill[b],
               refcount: occ.flags[b] & SHARED ? 2 : holder >= 0 ? 1 : 0,
               cached: holder < 0 && Boolean(occ.flags[b] & CACHED),
               growth: holder >= 0 && Boolean(occ.flags[b] & GROWTH) };
    });
  }

  // How the map lays out `numBlocks` in `width` pixels and at most `maxHeight`: a square of
  // `px` pixels per block (the largest that fits, at least 2), else cells of `perCell`
  // consecutive blocks, each drawn as the shares of its blocks' states.
  function poolLayout(numBlocks, width, maxHeight) {
    for (const px of [10, 8, 6, 5, 4, 3, 2]) {
      const cols = Math.max(1, Math.floor(width / px));
      const rows = Math.ceil(numBlocks / cols);
      if (rows * px <= maxHeight) return { mode: "blocks", px, cols, rows, perCell: 1, gap: px >= 5 ? 1 : 0 };
    }
    const px = 8;
    const cols = Math.max(1, Math.floor(width / px));
    const perCell = Math.ceil(numBlocks / (cols * Math.max(1, Math.floor(maxHeight / px))));
    const rows = Math.ceil(Math.ceil(numBlocks / perCell) / cols);
    return { mode: "cells", px, cols, rows, perCell, gap: 1 };
  }

  // Blocks first .. last - 1 counted by state: used (held), shared, growth (held, taken as
  // their sequence grew), cached (free, kept by the prefix cache), free; and blocks per owner.
  function countBlocks(occ, first, last) {
    const counts = { used: 0, shared: 0, growth: 0, cached: 0, free: 0, partly: 0, owners: new Map() };
    for (let b = first; b < last; b++) {
      const holder = occ.owner[b], flags = occ.flags[b];
      if (holder < 0) {
        if (flags & CACHED) counts.cached++; else counts.free++;
        continue;
      }
      counts.used++;
      if (flags & SHARED) counts.shared++;
      else if (flags & GROWTH) counts.growth++;
      if (occ.fill[b] < occ.block_size) counts.partly++;
      counts.owners.set(holder, (counts.owners.get(holder) || 0) + 1);
    }
    return counts;
  }

  function describeBlocks(occ, first, last) {
    if (last - first === 1) {
      const b = first, holder = occ.owner[b];
      if (holder < 0) return occ.flags[b] & CACHED ? `block ${b}: cached prefix, free to reuse` : `block ${b}: free`;
      let text = `block ${b}: ${occ.owners[holder]}, ${occ.fill[b]} positions written`;
      if (occ.flags[b] & SHARED) text += ", shared";
      if (occ.flags[b] & GROWTH) text += ", taken as it grew (not reserved at admission)";
      return text;
    }
    const c = countBlocks(occ, first, last);
    const top = [...c.owners].sort((a, b) => b[1] - a[1]).slice(0, 3)
      .map(([holder, n]) => `${view.label(occ.owners[holder])} ${n}`).join(", ");
    return `blocks ${first}\u2013${last - 1}: ${c.used} used` +
      (c.owners.size ? ` by ${c.owners.size} (${top}${c.owners.size > 3 ? ", ..." : ""})` : "") +
      `, ${c.shared} shared, ${c.growth} grown, ${c.cached} cached, ${c.free} free`;
  }

  function paint(data, width, x0, y0, w, h, rgb) {
    for (let y = y0; y < y0 + h; y++) {
      let i = (y * width + x0) * 4;
      for (let x = 0; x < w; x++, i += 4) {
        data[i] = rgb[0]; data[i + 1] = rgb[1]; data[i + 2] = rgb[2]; data[i + 3] = 255;
      }
    }
  }

  // The compact map on a <canvas>: one square per block, or per cell of blocks a column of its
  // shares (bottom up: held as reserved in its main owner's colour, grown in a darker shade,
  // shared in black, cached in blue, free in grey). Hovering writes what is under the pointer.
  function drawPoolMap(box, occ, colorOf) {
    let canvas = box.querySelector("canvas.pool-canvas");
    if (!canvas) {
      box.replaceChildren();
      canvas = el("canvas", { class: "pool-canvas" });
      const info = el("div", { class: "pool-info", text: "point at the map to see its blocks" });
      box.append(canvas, info, el("div", { class: "pool-legend" }));
      canvas.addEventListener("mousemove", (event) => {
        const drawn = box.kvDrawn;
        if (!drawn) return;
        const rect = canvas.getBoundingClientRect();
        const col = Math.floor((event.clientX - rect.left) / drawn.layout.px);
        const row = Math.floor((event.clientY - rect.top) / drawn.layout.px);
        const first = (row * drawn.layout.cols + col) * drawn.layout.perCell;
        if (col < 0 || col >= drawn.layout.cols || first < 0 || first >= drawn.occ.num_blocks) return;
        info.textContent = describeBlocks(drawn.occ, first,
                                          Math.min(drawn.occ.num_blocks, first + drawn.layout.perCell));
      });
    }
    box.classList.add("pool-map");
    const width = Math.max(120, box.clientWidth || 640);
    const layout = poolLayout(occ.num_blocks, width, MAP_HEIGHT);
    const w = layout.cols * layout.px, h = Math.max(1, layout.rows * layout.px);
    if (canvas.width !== w) canvas.width = w;
    if (canvas.height !== h) canvas.height = h;
    canvas.style.width = `${w}px`;
    canvas.style.height = `${h}px`;
    const context = canvas.getContext("2d");
    const image = context.createImageData(w, h);
    const data = image.data;
    const colors = occ.owners.map((id) => {
      const rgb = rgbOf(colorOf(id));
      return { rgb, pale: paleRgb(rgb), dark: darkRgb(rgb) };
    });
    const side = layout.px - layout.gap;
    const n = occ.num_blocks;
    if (layout.mode === "blocks") {
      for (let b = 0; b < n; b++) {
        const holder = occ.owner[b], flags = occ.flags[b];
        let rgb;
        if (holder < 0) rgb = flags & CACHED ? CACHED_RGB : FREE_RGB;
        else if (flags & SHARED) rgb = SHARED_RGB;
        else if (flags & GROWTH) rgb = colors[holder].dark;
        else rgb = occ.fill[b] < occ.block_size ? colors[holder].pale : colors[holder].rgb;
        paint(data, w, (b % layout.cols) * layout.px, Math.floor(b / layout.cols) * layout.px, side, side, rgb);
      }
    } else {
      const numCells = Math.ceil(n / layout.perCell);
      for (let cell = 0; cell < numCells; cell++) {
        const first = cell * layout.perCell, last = Math.min(n, first + layout.perCell);
        const c = countBlocks(occ, first, last);
        let main = null, most = 0;
        for (const [holder, count] of c.owners) if (count > most) { main = holder; most = count; }
        const held = main === null ? null : colors[main];
        const parts = [[c.used - c.shared - c.growth, held && held.rgb], [c.growth, held && held.dark],
                       [c.shared, SHARED_RGB], [c.cached, CACHED_RGB], [c.free, FREE_RGB]];
        const x = (cell % layout.cols) * layout.px, top = Math.floor(cell / layout.cols) * layout.px;
        let done = 0, bottom = top + side;
        for (const [count, rgb] of parts) {
          if (!count) continue;
          done += count;
          const edge = top + side - Math.round((done / (last - first)) * side);
          if (bottom > edge) paint(data, w, x, edge, side, bottom - edge, rgb);
          bottom = edge;
        }
      }
    }
    context.putImageData(image, 0, 0);
    box.kvDrawn = { occ, layout };
    const total = countBlocks(occ, 0, n);
    Object.assign(box.dataset, { mode: layout.mode, perCell: String(layout.perCell), px: String(layout.px),
                                 used: String(total.used), shared: String(total.shared),
                                 growth: String(total.growth), cached: String(total.cached),
                                 free: String(total.free), owners: String(total.owners.size) });
    const legend = box.querySelector(".pool-legend");
    const swatch = (rgb, text) => el("span", {}, el("i", { style: `background:${css(rgb)}` }), text);
    legend.replaceChildren(
      el("span", { text: layout.mode === "blocks" ? `one square per block (${layout.cols} a row):`
                                                  : `one cell per ${layout.perCell} blocks (${layout.cols} a row), its shares from the bottom:` }),
      swatch([78, 121, 167], "held, in its owner's colour" + (layout.mode === "blocks" ? " (pale: being written)" : "")),
      swatch(darkRgb([78, 121, 167]), "taken as it grew"),
      swatch(SHARED_RGB, "shared"), swatch(CACHED_RGB, "cached"), swatch(FREE_RGB, "free"));
  }

  // The pool, whichever way fits: a tile per block up to `tileLimit` blocks, else the map.
  function drawOccupancy(box, occ, colorOf, tileLimit = TILE_LIMIT) {
    if (occ.num_blocks <= tileLimit) {
      box.classList.remove("pool-map");
      box.kvDrawn = null;
      drawPool(box, blocksOf(occ), occ.block_size, colorOf);
      box.dataset.mode = "tiles";
      return;
    }
    drawPoolMap(box, occ, colorOf);
  }

  // rows: [{request_id, num_tokens, is_prefill, start, samples}] in plan order
  function drawRows(box, textBox, rows, maxRows, stalledIds, colorOf) {
    box.replaceChildren();
    const texts = [];
    for (const row of rows) {
      // A speculative decode chunk: its last `guesses` rows are guessed tokens under verification.
      const guesses = row.guesses || 0;
      for (let k = 0; k < row.num_tokens; k++) {
        const kind = row.is_prefill ? "prefill" : k >= row.num_tokens - guesses ? "guess" : "decode";
        box.append(el("div", { class: `row ${kind}`,
                               "data-request": row.request_id,
                               "data-kind": kind,
                               style: `background:${colorOf(row.request_id)}`,
                               title: row.start === undefined ? view.label(row.request_id)
                                                              : `${row.request_id} position ${row.start + k}`,
                               text: { prefill: "P", decode: "D", guess: "G" }[kind] }));
      }
      if (row.is_prefill) {
        const name = view.label(row.request_id);
        texts.push(row.start === undefined
          ? `${name} prefill ${row.num_tokens} positions`
          : `${name} prefill positions ${row.start}\u2013${row.start + row.num_tokens - 1}` +
            (row.samples ? " (prompt done: first token)" : ""));
      } else if (guesses) {
        const kept = row.kept === null || row.kept === undefined ? "not verified" : `${row.kept} kept`;
        texts.push(`${view.label(row.request_id)} decode + ${guesses} guesses (${kept})`);
      } else texts.push(`${view.label(row.request_id)} decode`);
    }
    const used = rows.reduce((sum, row) => sum + row.num_tokens, 0);
    for (let k = used; k < maxRows; k++) {
      box.append(el("div", { class: "row unused", text: "\u00b7" }));
    }
    if (stalledIds.length) texts.push(`no rows for ${list(stalledIds)}`);
    textBox.textContent = texts.length ? texts.join("; ") : "no rows";
  }

  return { view, PALETTE, SHARED, GROWTH, CACHED, TILE_LIMIT, el, pale, chip, list, colorAllocator,
           drawQueue, drawSlots, drawPool, drawRows, blocksOf, poolLayout, countBlocks, describeBlocks,
           drawPoolMap, drawOccupancy };
})();
