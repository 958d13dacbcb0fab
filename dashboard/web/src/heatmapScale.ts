// The colour scale of heatmaps. A page that shows heatmaps to be compared (the layers of one run) passes
// every one of them the same domain, `domainOf` over all of them, so equal colours are equal values; a
// heatmap given none is scaled to itself, and its colour bar says so.
// Matrices are `matrix[c][r]` (column c, row r) as in Heatmap.svelte; nulls (no data) are skipped.

export type Domain = [number, number];
export type Matrix = (number | null | undefined)[][];

/** The colour domain over every matrix in `matrices`: [min(0, smallest), largest] for sequential values
 *  (a share's colour starts at 0, not at the smallest share shown), [-m, m] with m the largest magnitude for
 *  diverging ones (0 stays the middle colour). A degenerate range (no data, all zero) is widened so it
 *  still maps to colours. */
export function domainOf(matrices: Matrix[], diverging = false): Domain {
  let max = -Infinity, min = Infinity;
  for (const m of matrices) for (const col of m) for (const v of col) {
    if (v === null || v === undefined || !Number.isFinite(v)) continue;
    if (v > max) max = v;
    if (v < min) min = v;
  }
  if (max === -Infinity) return diverging ? [-1, 1] : [0, 1];
  if (diverging) {
    const m = Math.max(Math.abs(min), Math.abs(max));
    return m > 0 ? [-m, m] : [-1, 1];
  }
  const lo = Math.min(0, min);
  return [lo, max > lo ? max : lo + 1];
}

/** A tick label: three significant digits, no trailing zeros ("0.0313", "1", "-0.05"), exponent for
 *  very small or large magnitudes. */
export function tickLabel(v: number): string {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a < 1e-3 || a >= 1e4) return v.toExponential(2);
  return String(Number(v.toPrecision(3)));
}
