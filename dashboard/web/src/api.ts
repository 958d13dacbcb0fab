// The dashboard's JSON and server-sent-events client. The token (when the server needs one) comes from the
// page's ?token= and is passed on with every request.
const token = new URLSearchParams(location.search).get("token");

function withToken(path: string): string {
  if (!token) return path;
  return path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token);
}

export async function getJSON<T = any>(path: string): Promise<T> {
  const res = await fetch(withToken(path));
  if (!res.ok) {
    let detail = res.statusText;
    try {
      detail = (await res.json()).detail ?? detail;
    } catch {}
    throw new Error(`${res.status}: ${detail}`);
  }
  return res.json();
}

// Live updates arrive up to every 0.2 s; a page redraws at most every `minMs` with everything that came
// since (rows and routing rows concatenated, the latest alerts): the redraw work stays bounded however fast
// the run logs, and the screen still trails the trainer by well under a second.
export const REDRAW_MS = 500;

export function stream(path: string, onUpdate: (data: any) => void, minMs = REDRAW_MS): () => void {
  const source = new EventSource(withToken(path));
  let pending: any = null;
  let last = 0;
  let timer: ReturnType<typeof setTimeout> | null = null;
  const flush = () => {
    timer = null;
    if (!pending) return;
    const u = pending;
    pending = null;
    last = performance.now();
    onUpdate(u);
  };
  source.addEventListener("update", (ev) => {
    const u = JSON.parse((ev as MessageEvent).data);
    if (pending) {
      pending.rows = pending.rows.concat(u.rows);
      pending.routing = pending.routing.concat(u.routing);
      pending.alerts = u.alerts;
    } else pending = u;
    const wait = last + minMs - performance.now();
    if (wait <= 0) flush();
    else if (!timer) timer = setTimeout(flush, wait);
  });
  return () => { source.close(); if (timer) clearTimeout(timer); };
}

// Append new points to a series without copying it point by point (one concat per update).
export function appendPoints(s: { x: number[]; y: (number | null)[] } | undefined, x: number[], y: (number | null)[]) {
  return s ? { x: s.x.concat(x), y: s.y.concat(y) } : { x, y };
}

export interface RunListing {
  id: string;
  name: string;
  kind: string;
  live: boolean;
  mtime: number;
  root: string;
  baseline: string | null;  // "active" | "total": a dense baseline trained beside an MoE
}

export interface Series {
  x: number[];
  y: (number | null)[];
  min: (number | null)[] | null;
  max: (number | null)[] | null;
}

export interface U16Matrix { encoding: "u16"; shape: [number, number]; scale: number; null: number; data: string }

// The routing endpoint's heatmap (encoding=u16): base64 little-endian uint16 -> rows of shares (null: missing).
export function decodeU16(m: U16Matrix): (number | null)[][] {
  // a plain loop over the decoded string: Uint8Array.from with a callback per byte was most of the ~1 s
  // the page spent drawing the 24 layers of a long run
  const text = atob(m.data);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const [rows, cols] = m.shape;
  const out: (number | null)[][] = new Array(rows);
  for (let r = 0; r < rows; r++) {
    const row: (number | null)[] = new Array(cols);
    for (let c = 0, o = 2 * r * cols; c < cols; c++, o += 2) {
      const q = bytes[o] | (bytes[o + 1] << 8);  // little-endian, whatever the platform
      row[c] = q === m.null ? null : q / m.scale;
    }
    out[r] = row;
  }
  return out;
}
