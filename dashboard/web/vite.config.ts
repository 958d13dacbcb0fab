import { defineConfig } from "vite";
import { svelte } from "@sveltejs/vite-plugin-svelte";

// Deterministic output (CI diffs a fresh build against dashboard/static): fixed file names, no hashes.
export default defineConfig({
  plugins: [svelte()],
  base: "./",
  build: {
    outDir: process.env.DASHBOARD_OUT_DIR || "../static",
    emptyOutDir: true,
    sourcemap: false,
    rollupOptions: {
      output: {
        entryFileNames: "assets/app.js",
        chunkFileNames: "assets/[name].js",
        assetFileNames: "assets/[name][extname]",
      },
    },
  },
});
