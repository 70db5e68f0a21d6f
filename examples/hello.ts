// A sample TypeScript Code node: validates the state with zod, formats a date with date-fns.
import { z } from "npm:zod@3";
import { format } from "npm:date-fns@4";

const State = z.object({ name: z.string(), items: z.array(z.number()) });

export default function main(state: unknown) {
  const s = State.parse(state);
  console.log(`greeting ${s.name}`); // kept as logs, never the output
  return {
    greeting: `Hello, ${s.name}!`,
    total: s.items.reduce((a, b) => a + b, 0),
    day: format(new Date(0), "yyyy-MM-dd"),
  };
}
