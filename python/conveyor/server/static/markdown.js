// A small, safe Markdown renderer: the text is HTML-escaped first, then formatted, so
// nothing the model writes can become markup. Handles fenced code blocks (an unclosed
// fence, as while streaming, is code to the end), inline code, headings, bullet and
// numbered lists, bold and italics, paragraphs and line breaks.

export function escapeHtml(s) {
  return s.replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(escaped) {
  // `code` spans first; the rest gets bold and italics
  return escaped.split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
    return part
      .replace(/\*\*(?=\S)([^*]+?)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=\S)([^*]+?)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=\S)([^_]+?)_(?!\w)/g, "$1<em>$2</em>");
  }).join("");
}

export function renderMarkdown(src) {
  const lines = escapeHtml(String(src)).split("\n");
  const out = [];
  let para = [];
  let list = null; // "ul" or "ol"
  let code = null; // lines of an open fence
  let lang = "";
  const flushPara = () => { if (para.length) { out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; } };
  const closeList = () => { if (list) { out.push("</" + list + ">"); list = null; } };
  for (const line of lines) {
    if (code !== null) {
      if (/^\s*```\s*$/.test(line)) {
        out.push(codeBlock(code, lang));
        code = null;
      } else {
        code.push(line);
      }
      continue;
    }
    let m;
    if ((m = /^\s*```\s*([\w+#.-]*)/.exec(line))) {
      flushPara(); closeList();
      code = []; lang = m[1];
    } else if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
      flushPara(); closeList();
      const level = Math.min(6, m[1].length + 2); // h3..h6 inside a message
      out.push(`<h${level}>` + inline(m[2]) + `</h${level}>`);
    } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line)) || (m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
      flushPara();
      const kind = /^\s*\d/.test(line) ? "ol" : "ul";
      if (list !== kind) { closeList(); out.push("<" + kind + ">"); list = kind; }
      out.push("<li>" + inline(m[1]) + "</li>");
    } else if (/^\s*$/.test(line)) {
      flushPara(); closeList();
    } else {
      closeList();
      para.push(line);
    }
  }
  if (code !== null) out.push(codeBlock(code, lang));
  flushPara(); closeList();
  return out.join("");
}

function codeBlock(lines, lang) {
  const cls = lang ? ` class="language-${lang.replace(/[^\w-]/g, "")}"` : "";
  return `<pre><code${cls}>` + lines.join("\n") + "</code></pre>";
}
