// The only packages TypeScript code nodes may import. Keep this list equal to
// STUDIO_CODE_TS_PACKAGES (default "npm:zod@3,npm:date-fns@4"): a test checks it.
import "npm:zod@3";
import "npm:date-fns@4";
