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

  // rows: [{request_id, num_tokens, is_prefill, start, samples}] in plan order
  function drawRows(box, textBox, rows, maxRows, stalledIds, colorOf) {
    box.replaceChildren();
    const texts = [];
    for (const row of rows) {
      for (let k = 0; k < row.num_tokens; k++) {
        box.append(el("div", { class: row.is_prefill ? "row prefill" : "row decode",
                               "data-request": row.request_id,
                               "data-kind": row.is_prefill ? "prefill" : "decode",
                               style: `background:${colorOf(row.request_id)}`,
                               title: row.start === undefined ? view.label(row.request_id)
                                                              : `${row.request_id} position ${row.start + k}`,
                               text: row.is_prefill ? "P" : "D" }));
      }
      if (row.is_prefill) {
        const name = view.label(row.request_id);
        texts.push(row.start === undefined
          ? `${name} prefill ${row.num_tokens} positions`
          : `${name} prefill positions ${row.start}\u2013${row.start + row.num_tokens - 1}` +
            (row.samples ? " (prompt done: first token)" : ""));
      } else texts.push(`${view.label(row.request_id)} decode`);
    }
    const used = rows.reduce((sum, row) => sum + row.num_tokens, 0);
    for (let k = used; k < maxRows; k++) {
      box.append(el("div", { class: "row unused", text: "\u00b7" }));
    }
    if (stalledIds.length) texts.push(`no rows for ${list(stalledIds)}`);
    textBox.textContent = texts.length ? texts.join("; ") : "no rows";
  }

  return { view, PALETTE, el, pale, chip, list, colorAllocator, drawQueue, drawSlots, drawPool, drawRows };
})();
