// Svelte compiler options for the dashboard (TypeScript in <script lang="ts"> is handled by Svelte 5 itself).
export default {};
