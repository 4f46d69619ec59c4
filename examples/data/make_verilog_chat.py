"""Writes verilog_chat.jsonl: short, original Verilog question/answer chats for the demo.

Each line is {"messages": [...]}: a system prompt, a user request, and an assistant turn with a short
reasoning trace and the module; some chats add a follow-up turn. Run it to regenerate the file exactly
(the generator is seeded).
"""

import json
import random
from pathlib import Path

SYSTEMS = (
    "You are a hardware design assistant. Answer with synthesizable Verilog-2001.",
    "You write clean, synthesizable Verilog for FPGA designs. Keep answers short.",
    "You are an RTL engineer. Reply with one Verilog module and nothing else.",
)


def counter(r, w, name):
    return (
        f"Write a {w}-bit up counter named {name} with synchronous reset and an enable input.",
        f"A {w}-bit register incremented on each rising edge while en is high; rst clears it first.",
        f"module {name} (\n  input clk,\n  input rst,\n  input en,\n  output reg [{w - 1}:0] count\n);\n"
        f"  always @(posedge clk) begin\n    if (rst) count <= {w}'d0;\n    else if (en) count <= count + 1'b1;\n"
        f"  end\nendmodule",
    )


def mux(r, w, name):
    return (
        f"I need a 2-to-1 multiplexer for {w}-bit buses. Call it {name}.",
        "A continuous assignment with the select line choosing between the two inputs is enough.",
        f"module {name} (\n  input [{w - 1}:0] a,\n  input [{w - 1}:0] b,\n  input sel,\n"
        f"  output [{w - 1}:0] y\n);\n  assign y = sel ? b : a;\nendmodule",
    )


def adder(r, w, name):
    return (
        f"Give me a {w}-bit adder {name} with carry in and carry out.",
        f"Concatenate the carry out with the {w}-bit sum and add the three operands in one assignment.",
        f"module {name} (\n  input [{w - 1}:0] a,\n  input [{w - 1}:0] b,\n  input cin,\n"
        f"  output [{w - 1}:0] sum,\n  output cout\n);\n  assign {{cout, sum}} = a + b + cin;\nendmodule",
    )


def shift(r, w, name):
    direction = r.choice(("left", "right"))
    expr = f"{{q[{w - 2}:0], din}}" if direction == "left" else f"{{din, q[{w - 1}:1]}}"
    return (
        f"Write a {w}-bit serial-in shift register {name} that shifts {direction} every clock.",
        f"On each rising edge the register drops one end bit and takes din at the other ({direction} shift).",
        f"module {name} (\n  input clk,\n  input din,\n  output reg [{w - 1}:0] q\n);\n"
        f"  always @(posedge clk) q <= {expr};\nendmodule",
    )


def parity(r, w, name):
    kind = r.choice(("even", "odd"))
    op = "^data" if kind == "even" else "~^data"
    return (
        f"How do I compute {kind} parity of a {w}-bit word in Verilog? Name the module {name}.",
        f"The reduction XOR of all bits gives even parity; inverting it gives odd parity. Here: {kind}.",
        f"module {name} (\n  input [{w - 1}:0] data,\n  output parity\n);\n  assign parity = {op};\nendmodule",
    )


def comparator(r, w, name):
    return (
        f"Design {name}, a {w}-bit unsigned comparator with eq, lt and gt outputs.",
        "Three continuous assignments, one per relation; unsigned compare is the default for reg/wire vectors.",
        f"module {name} (\n  input [{w - 1}:0] a,\n  input [{w - 1}:0] b,\n  output eq,\n  output lt,\n"
        f"  output gt\n);\n  assign eq = (a == b);\n  assign lt = (a < b);\n  assign gt = (a > b);\nendmodule",
    )


def dff(r, w, name):
    return (
        f"Write a {w}-bit register {name} with an asynchronous active-low reset.",
        "Put the reset edge in the sensitivity list so it acts without waiting for the clock.",
        f"module {name} (\n  input clk,\n  input rst_n,\n  input [{w - 1}:0] d,\n  output reg [{w - 1}:0] q\n);\n"
        f"  always @(posedge clk or negedge rst_n) begin\n    if (!rst_n) q <= {w}'d0;\n    else q <= d;\n"
        f"  end\nendmodule",
    )


def edge(r, w, name):
    kind = r.choice(("rising", "falling"))
    expr = "sig & ~prev" if kind == "rising" else "~sig & prev"
    return (
        f"Make a {kind}-edge detector called {name} that pulses for one clock.",
        f"Register the input once and compare it with its previous value: a {kind} edge is {expr}.",
        f"module {name} (\n  input clk,\n  input sig,\n  output pulse\n);\n  reg prev;\n"
        f"  always @(posedge clk) prev <= sig;\n  assign pulse = {expr};\nendmodule",
    )


def divider(r, w, name):
    n = 2 ** r.randint(1, 4)
    return (
        f"Write {name}, a clock divider by {n} using a counter.",
        f"A counter of log2({n}) bits wraps every {n} cycles; its top bit toggles at the divided rate.",
        f"module {name} (\n  input clk,\n  input rst,\n  output clk_out\n);\n"
        f"  reg [{max(n.bit_length() - 2, 0)}:0] cnt;\n"
        f"  always @(posedge clk) begin\n    if (rst) cnt <= 0;\n    else cnt <= cnt + 1'b1;\n  end\n"
        f"  assign clk_out = cnt[{max(n.bit_length() - 2, 0)}];\nendmodule",
    )


DESIGNS = (counter, mux, adder, shift, parity, comparator, dff, edge, divider)
NAMES = ("core", "unit", "blk", "top", "dp", "ctl", "stage", "slice")
FOLLOW_UPS = (
    ("Can you add a one-line comment describing the module?", "A single // comment above the module header.",
     lambda code: "// " + code.split("(")[0].replace("module ", "") + ": generated for the gemport demo\n" + code),
    ("Please rename the module with a _v2 suffix.", "Only the module name in the header changes.",
     lambda code: code.replace(" (\n", "_v2 (\n", 1)),
)


def conversation(r: random.Random) -> dict:
    design = r.choice(DESIGNS)
    width = r.choice((4, 8, 12, 16, 24, 32))
    name = f"{design.__name__}_{r.choice(NAMES)}{width}"
    question, reasoning, code = design(r, width, name)
    messages = [
        {"role": "system", "content": r.choice(SYSTEMS)},
        {"role": "user", "content": question},
        {"role": "assistant", "reasoning": reasoning, "content": code},
    ]
    if r.random() < 0.3:
        ask, why, change = r.choice(FOLLOW_UPS)
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "reasoning": why, "content": change(code)}]
    return {"messages": messages}


def main() -> None:
    r = random.Random(2026)
    rows = [conversation(r) for _ in range(320)]
    out = Path(__file__).with_name("verilog_chat.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
