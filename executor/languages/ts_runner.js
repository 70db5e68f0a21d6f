// The runner that executes ONE TypeScript code node inside the sandbox, on Deno.
//
// This file's text is the MAIN MODULE of `deno run`, passed in argv as a
// `data:application/javascript;base64,...` URL: it is not imported by the server and never
// baked into an image, so any image with a deno binary works.
//
// Protocol (the same for every language): stdin is one JSON header line
// `{"code": ..., "marker": ...}` followed by the state as JSON. The user's code is DATA: it is
// imported as its own module, `data:application/typescript;base64,<code>`, and never pasted
// into this source (Dify CVE-2025-3466: a hoisted user function replaced a global the bootstrap
// relied on). Stack traces keep the user's line numbers (Deno source-maps the transpiled
// TypeScript); the module's URL is shown as `main.ts`.
//
// Everything the code prints goes to stderr (the logs): console.* is rebuilt on stderr,
// Deno.stdout IS Deno.stderr and process.stdout is process.stderr. The code could still reach
// fd 1 on purpose (Deno[Deno.internal].core.print, a Worker's own console), so the result is
// a FRAME on stdout: marker + one JSON object + marker. The marker is a per-run secret (an HMAC
// of the job id under a per-process key) that arrives in the stdin header, which this runner
// reads completely before the code is imported: the code can neither know it nor forge or end a
// frame, and whatever else reaches fd 1 is ignored by the executor.
//
// Every function and object the runner needs after the import is captured BEFORE the import,
// so user code that replaces globals (JSON, Deno.stdout, Deno.exit, console, prototypes) cannot
// change what the runner writes. Objects the runner serialises have a null prototype, so even
// an Object.prototype.toJSON cannot rewrite a frame.
//
// argv (Deno.args): [config JSON] with outputMaxBytes, packages and the sentences to show
// (the executor owns the wording).

const call = Function.prototype.call;
const uncurry = (fn) => call.bind(fn);
const ReflectApply = Reflect.apply;
const ObjectDefineProperty = Object.defineProperty;
const ObjectGetOwnPropertyDescriptor = Object.getOwnPropertyDescriptor;
const JSONStringify = JSON.stringify;
const JSONParse = JSON.parse;
const NumberIsFinite = Number.isFinite;
const StringIndexOf = uncurry(String.prototype.indexOf);
const StringSlice = uncurry(String.prototype.slice);
const StringCharCodeAt = uncurry(String.prototype.charCodeAt);
const StringStartsWith = uncurry(String.prototype.startsWith);
const TypedArrayPrototype = Object.getPrototypeOf(Uint8Array.prototype);
const TypedArrayLength = uncurry(ObjectGetOwnPropertyDescriptor(TypedArrayPrototype, "length").get);
const TypedArraySubarray = uncurry(TypedArrayPrototype.subarray);
// Views for writing are made with the captured constructor, never with subarray(): subarray
// asks the array's constructor[Symbol.species] for the new view, and user code can set that
// (Uint8Array.prototype.constructor) to a function that is handed the buffer: it would read
// the marker and could rewrite the frame.
const Uint8ArrayCtor = Uint8Array;
const TypedArrayBuffer = uncurry(ObjectGetOwnPropertyDescriptor(TypedArrayPrototype, "buffer").get);
const TypedArrayByteOffset = uncurry(
  ObjectGetOwnPropertyDescriptor(TypedArrayPrototype, "byteOffset").get,
);
const TypedArrayIndexOf = uncurry(TypedArrayPrototype.indexOf);
const Uint8ArrayToBase64 = uncurry(Uint8Array.prototype.toBase64);
const RegExpExec = uncurry(RegExp.prototype.exec);
const encoder = new TextEncoder();
const encode = uncurry(TextEncoder.prototype.encode).bind(null, encoder);
const decoder = new TextDecoder();
const decode = uncurry(TextDecoder.prototype.decode).bind(null, decoder);
const inspect = Deno.inspect;
const exit = Deno.exit;
const realStdout = Deno.stdout;
const realStderr = Deno.stderr;
const writeStdout = uncurry(realStdout.writeSync).bind(null, realStdout);
const writeStderr = uncurry(realStderr.writeSync).bind(null, realStderr);
const addEventListener = uncurry(globalThis.addEventListener).bind(null, globalThis);
const preventDefault = uncurry(Event.prototype.preventDefault);
const internals = Deno[Deno.internal];
const ConsoleClass = internals?.Console;

const USER_URL_PREFIX = "data:application/typescript;base64,";
const RUNNER_URL_PREFIX = "data:application/javascript;base64,";
const FILENAME = "main.ts";
const NOT_IN_CACHE = /npm package not found in cache: "([^"]+)"/;
const NO_MATCHING_VERSION = /Could not find npm package '([^']+)' matching '([^']+)'/;
const SPECIFIER_NOT_IN_CACHE = /Specifier not found in cache: "([^"]+)"/;
const CACHE_UNREADABLE = /Failed loading [^\n]* for package[\s\S]*Permission denied/;

// Null prototypes: a lookup of a sentence can never reach something the code put on
// Object.prototype.
const config = { __proto__: null, ...JSONParse(Deno.args[0] ?? "{}") };
const outputMaxBytes = config.outputMaxBytes ?? 16 * 1024 * 1024;
const packages = [...(config.packages ?? [])];
const text = { __proto__: null, ...config.messages };
// the same numbers as executor/outputs.py
const OUTPUT_MAX_DEPTH = 100;
const MESSAGE_MAX_CHARS = 64 * 1024;

let marker = "";
// The end-of-logs mark the host asked for (header "end"), written to stderr after the frame:
// the result and the logs are complete without waiting for the process to end.
let endMark = "";
let finished = false;
let waitingForMain = false;

function writeAll(write, bytes) {
  let offset = 0;
  const total = TypedArrayLength(bytes);
  const buffer = TypedArrayBuffer(bytes);
  const start = TypedArrayByteOffset(bytes);
  while (offset < total) {
    offset += write(new Uint8ArrayCtor(buffer, start + offset, total - offset));
  }
}

function printErr(message) {
  try {
    writeAll(writeStderr, encode(message));
  } catch {
    // stderr is gone: nothing left to tell
  }
}

// Writes the frame and ends the process: nothing the code left running can add to the result.
function finish(json) {
  if (finished) return;
  finished = true;
  try {
    writeAll(writeStdout, encode(marker + json + marker));
  } catch {
    exit(1);
  }
  if (endMark !== "") printErr(endMark);
  exit(0);
}

// template with {key} placeholders filled from values (no String.prototype.replace: the code
// may have replaced it)
function fill(template, values) {
  let out = "";
  let from = 0;
  for (;;) {
    const open = StringIndexOf(template, "{", from);
    const close = open < 0 ? -1 : StringIndexOf(template, "}", open);
    if (close < 0) break;
    const key = StringSlice(template, open + 1, close);
    const known = ObjectGetOwnPropertyDescriptor(values, key);
    out += StringSlice(template, from, open) + (known ? known.value : "{" + key + "}");
    from = close + 1;
  }
  return out + StringSlice(template, from);
}

function fail(code, message) {
  if (typeof message !== "string") message = "";
  if (message.length > MESSAGE_MAX_CHARS) {
    message = StringSlice(message, 0, MESSAGE_MAX_CHARS) + "\n[cut: " +
      (message.length - MESSAGE_MAX_CHARS) + " more characters]";
  }
  // A lone surrogate in the message is escaped by JSON.stringify (\ud800): the frame stays
  // valid UTF-8 and the executor makes the text storable (U+FFFD).
  const error = { __proto__: null, code, message };
  finish(JSONStringify({ __proto__: null, ok: false, error }));
}

// --- turning an error into text the admin can act on ------------------------------------

function isBase64Char(c) {
  // A-Z a-z 0-9 + / = and the "." of Deno's abbreviation (first chars......last chars)
  return (c >= 65 && c <= 90) || (c >= 97 && c <= 122) || (c >= 48 && c <= 57) ||
    c === 43 || c === 47 || c === 61 || c === 46;
}

// The user's module URL (full, or as Deno abbreviates it in stack frames) -> main.ts.
function renameUserModule(s) {
  let out = "";
  let from = 0;
  for (;;) {
    const at = StringIndexOf(s, USER_URL_PREFIX, from);
    if (at < 0) break;
    let end = at + USER_URL_PREFIX.length;
    while (end < s.length && isBase64Char(StringCharCodeAt(s, end))) end++;
    out += StringSlice(s, from, at) + FILENAME;
    from = end;
  }
  return out + StringSlice(s, from);
}

// Drops the runner's own stack frames and Deno's "run again with --allow-x" hint (an admin
// cannot grant a permission to a code node).
function dropRunnerLines(s) {
  let out = "";
  let from = 0;
  while (from <= s.length) {
    let nl = StringIndexOf(s, "\n", from);
    if (nl < 0) nl = s.length;
    let line = StringSlice(s, from, nl);
    if (StringIndexOf(line, RUNNER_URL_PREFIX) < 0) {
      const hint = StringIndexOf(line, ", run again with the --allow-");
      if (hint >= 0) line = StringSlice(line, 0, hint);
      out += (out === "" ? "" : "\n") + line;
    }
    from = nl + 1;
  }
  return out;
}

function describe(err) {
  let raw;
  try {
    const stack = err !== null && typeof err === "object" ? err.stack : undefined;
    raw = typeof stack === "string" ? stack : "Uncaught " + inspect(err);
  } catch {
    raw = "Uncaught error that could not be described";
  }
  return dropRunnerLines(renameUserModule(raw));
}

function field(err, name) {
  try {
    const value = err !== null && typeof err === "object" ? err[name] : undefined;
    return typeof value === "string" ? value : "";
  } catch {
    return "";
  }
}

function missingSpec(message) {
  let m = RegExpExec(NOT_IN_CACHE, message);
  if (m !== null) {
    const name = m[1];
    for (let i = 0; i < packages.length; i++) {
      const spec = packages[i];
      if (spec === "npm:" + name || StringStartsWith(spec, "npm:" + name + "@")) return spec;
    }
    return "npm:" + name;
  }
  m = RegExpExec(NO_MATCHING_VERSION, message);
  if (m !== null) return "npm:" + m[1] + "@" + m[2];
  m = RegExpExec(SPECIFIER_NOT_IN_CACHE, message);
  if (m !== null) return m[1];
  return null;
}

// The code threw (or its import failed): CODE_ERROR, or CODE_INVALID for a parse error.
function codeError(err, loading) {
  const name = field(err, "name");
  const message = field(err, "message");
  const described = describe(err);
  if (name === "NotCapable" || name === "PermissionDenied") {
    return fail("CODE_ERROR", text.permission + "\n" + described);
  }
  if (RegExpExec(CACHE_UNREADABLE, message) !== null) {
    return fail("CODE_ERROR", text.cacheUnreadable + "\n" + described);
  }
  const spec = missingSpec(message);
  if (spec !== null) {
    const sentence = fill(text.missingPackage, { __proto__: null, spec });
    return fail("CODE_ERROR", sentence + "\n" + described);
  }
  if (loading && field(err, "code") === "ERR_MODULE_NOT_FOUND" &&
      StringStartsWith(message, "SyntaxError")) {
    // Deno's parser refused the module; it wraps its message in a TypeError: show its words.
    return fail("CODE_INVALID", dropRunnerLines(renameUserModule(message)) + "\n" + text.syntax);
  }
  if (loading && name === "SyntaxError" && StringIndexOf(described, "\n    at ") < 0) {
    // V8 refused to compile it (an early error: a redeclaration, `await` outside async...);
    // a SyntaxError the code throws while running (JSON.parse) has stack frames.
    return fail("CODE_INVALID", described + "\n" + text.syntax);
  }
  return fail("CODE_ERROR", described);
}

// --- the output -----------------------------------------------------------------------

function succeed(out) {
  // A main that returns nothing gives null, as a Python main without return gives None.
  if (out === undefined) out = null;
  let nonFinite = false;
  const replacer = (_key, value) => {
    if (typeof value === "number" && !NumberIsFinite(value)) {
      nonFinite = true;
      return null;
    }
    return value;
  };
  let json;
  try {
    json = JSONStringify(out, replacer);
  } catch (err) {
    if (field(err, "name") === "RangeError" &&
        StringIndexOf(field(err, "message"), "call stack") >= 0) {
      return fail("CODE_OUTPUT_INVALID", "main returned a value nested deeper than " +
        OUTPUT_MAX_DEPTH + " levels of objects and arrays (or a toJSON that recurses): " +
        "flatten it.");
    }
    const detail = describeBrief(err);
    return fail("CODE_OUTPUT_INVALID", fill(text.notJson, { __proto__: null, detail }));
  }
  if (json === undefined) {
    const detail = "a " + typeof out;
    return fail("CODE_OUTPUT_INVALID", fill(text.notJson, { __proto__: null, detail }));
  }
  if (nonFinite) {
    const detail = "NaN or Infinity";
    return fail("CODE_OUTPUT_INVALID", fill(text.notJson, { __proto__: null, detail }));
  }
  const problem = jsonProblem(json);
  if (problem !== null) return fail("CODE_OUTPUT_INVALID", problem);
  const bytes = TypedArrayLength(encode(json));
  if (bytes > outputMaxBytes) {
    return fail(
      "CODE_OUTPUT_INVALID",
      fill(text.tooLarge, { __proto__: null, size: "" + bytes, limit: "" + outputMaxBytes }),
    );
  }
  finish('{"ok": true, "output": ' + json + "}");
}

// What in JSON text (as JSON.stringify writes it) the executor would refuse: nesting deeper
// than OUTPUT_MAX_DEPTH, or a lone surrogate (JSON.stringify escapes one as \udxxx; a pair is
// written as itself). One pass over the text: no depth can make it recurse.
function jsonProblem(json) {
  let depth = 0;
  let inString = false;
  const n = json.length;
  for (let i = 0; i < n; i++) {
    const c = StringCharCodeAt(json, i);
    if (inString) {
      if (c === 92) { // backslash
        if (StringCharCodeAt(json, i + 1) === 117 && // u
            (StringCharCodeAt(json, i + 2) | 32) === 100) { // d
          const d = StringCharCodeAt(json, i + 3) | 32;
          if ((d >= 56 && d <= 57) || (d >= 97 && d <= 102)) { // 8 9 a-f
            return "main returned a string with a lone surrogate (" +
              StringSlice(json, i, i + 6) + "), which is not valid Unicode and cannot be " +
              "stored: return well-formed text (String.prototype.toWellFormed() fixes it).";
          }
        }
        i++;
      } else if (c === 34) {
        inString = false;
      }
    } else if (c === 34) {
      inString = true;
    } else if (c === 91 || c === 123) { // [ {
      if (++depth > OUTPUT_MAX_DEPTH) {
        return "main returned a value nested deeper than " + OUTPUT_MAX_DEPTH +
          " levels of objects and arrays: flatten it.";
      }
    } else if (c === 93 || c === 125) {
      depth--;
    }
  }
  return null;
}

function describeBrief(err) {
  const name = field(err, "name");
  const message = field(err, "message");
  return name || message ? name + ": " + message : "Uncaught " + inspect(err);
}

// --- the sandbox's own stdio ---------------------------------------------------------------

function redirectOutput() {
  // console.* -> stderr, with Deno's own formatting (console.table, %o, colours off).
  if (typeof ConsoleClass === "function") {
    const onStderr = new ConsoleClass((message) => printErr(message));
    ObjectDefineProperty(globalThis, "console", {
      value: onStderr, writable: true, enumerable: false, configurable: true,
    });
  } else {
    const methods = ["log", "info", "debug", "dir", "dirxml", "table", "group",
      "groupCollapsed", "count", "time", "timeLog", "timeEnd"];
    for (let i = 0; i < methods.length; i++) console[methods[i]] = console.error;
  }
  ObjectDefineProperty(Deno, "stdout", {
    value: realStderr, writable: true, enumerable: true, configurable: true,
  });
  // The Node `process` global is built lazily (touching it costs ~20 ms): patch it on first use.
  const processProperty = ObjectGetOwnPropertyDescriptor(globalThis, "process");
  if (processProperty && typeof processProperty.get === "function") {
    let patched = false;
    ObjectDefineProperty(globalThis, "process", {
      enumerable: processProperty.enumerable,
      configurable: true,
      get() {
        const process = ReflectApply(processProperty.get, globalThis, []);
        if (!patched) {
          patched = true;
          try {
            ObjectDefineProperty(process, "stdout", {
              get: () => process.stderr, enumerable: true, configurable: true,
            });
          } catch {
            // left as it is: anything it writes is outside the frame
          }
        }
        return process;
      },
      set(value) {
        if (typeof processProperty.set === "function") {
          ReflectApply(processProperty.set, globalThis, [value]);
        }
      },
    });
  }
}

// --- one run --------------------------------------------------------------------------------

async function run() {
  // All of stdin, before the code exists: the header (with the marker) is gone when it runs.
  const input = new Uint8Array(await new Response(Deno.stdin.readable).arrayBuffer());
  let newline = TypedArrayIndexOf(input, 10);
  if (newline < 0) newline = TypedArrayLength(input);
  const header = JSONParse(decode(TypedArraySubarray(input, 0, newline)));
  marker = header.marker;
  endMark = typeof header.end === "string" ? header.end : "";
  // Deno and the runner are up (RUNNER_STARTED in typescript.py): a later "unable to create
  // worker threads" in the logs is the node's, not the operator's.
  writeAll(writeStdout, encode("\x1estudio-runner-started\x1e"));
  const code = header.code;
  const stateText = decode(TypedArraySubarray(input, newline + 1));
  let state;
  try {
    state = stateText.trim() === "" ? {} : JSONParse(stateText);
  } catch (err) {
    return fail("CODE_INVALID", "The state is not valid JSON: " + describeBrief(err) + ".");
  }

  redirectOutput();
  // An error nobody awaited (a timer's throw, a forgotten promise) ends the run as an error,
  // as it would end a Node or Deno program, but with a result and the user's line number.
  addEventListener("error", (event) => {
    preventDefault(event);
    codeError(event.error, false);
  });
  addEventListener("unhandledrejection", (event) => {
    preventDefault(event);
    codeError(event.reason, false);
  });
  // Deno fires beforeunload when nothing is left to run; if main's promise is still pending
  // then, it can never settle.
  addEventListener("beforeunload", () => {
    if (waitingForMain) fail("CODE_ERROR", text.neverSettles);
  });

  const url = USER_URL_PREFIX + Uint8ArrayToBase64(encode(code));
  let module;
  try {
    module = await import(url);
  } catch (err) {
    return codeError(err, true);
  }
  const main = typeof module.main === "function" ? module.main : module.default;
  if (typeof main !== "function") {
    return fail("CODE_INVALID", text.noEntryPoint);
  }
  let out;
  try {
    waitingForMain = true;
    out = await ReflectApply(main, undefined, [state]);
  } catch (err) {
    return codeError(err, false);
  } finally {
    waitingForMain = false;
  }
  return succeed(out);
}

// No top-level await: the module finishes evaluating at once, so when nothing is left to run
// Deno fires beforeunload (handled above) instead of failing on a pending top-level await.
run().then(undefined, (err) => {
  fail("CODE_ERROR", "The TypeScript runner failed: " + describe(err));
});
