"""Write the post-training recipes' small data sets, made here from templates (no download): ``chat.jsonl`` (SFT
conversations), ``preferences.jsonl`` (DPO pairs) and ``preferences-heldout.jsonl`` (pairs on other questions, to
measure preference accuracy); for the RL recipe, sums of numbers below 20 with exact answers: ``rl-sft.jsonl`` (SFT
conversations), ``rl-prompts.jsonl`` (RL prompts with their ground truths) and ``rl-heldout.jsonl`` (prompts on sums
neither set holds, to measure exact-answer accuracy). Deterministic: ``python examples/post_training/make_examples.py``
rewrites the same files.

The tasks are small enough for the quickstart's 7.5M-parameter model: sums, reversing and upper-casing a word,
counting its letters. A chosen answer is right and polite; a rejected one is wrong (another number, another word) or
a curt refusal.
"""

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).parent
WORDS = (
    "apple river stone cloud garden window paper candle forest bridge market silver yellow summer winter rabbit "
    "castle pepper orange violet spider rocket planet marble copper butter basket harbor lantern meadow island"
).split()
REFUSALS = ["No.", "I will not answer that.", "Figure it out yourself.", "WHY WOULD I KNOW", "Ask someone else."]


def task(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    """A question, its right answer and a wrong one."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."
    word = rng.choice(words)
    other = word
    while other in (word, word[::-1]):  # a wrong answer, never the right one by chance
        other = "".join(rng.sample(word, len(word)))
    if kind == 1:
        return (
            f"Reverse the word '{word}'.",
            f"Reversed, '{word}' is '{word[::-1]}'.",
            f"Reversed, '{word}' is '{other}'.",
        )
    if kind == 2:
        return (
            f"Write '{word}' in capital letters.",
            f"In capitals: {word.upper()}.",
            f"In capitals: {other.upper()}.",
        )
    wrong = len(word) + rng.choice([-2, -1, 1, 2])
    return (
        f"How many letters are in '{word}'?",
        f"'{word}' has {len(word)} letters.",
        f"'{word}' has {wrong} letters.",
    )


def conversation(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def write(name: str, lines: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(line) + "\n" for line in lines))


def main() -> None:
    rng = random.Random(40)
    held_out_words = WORDS[-6:]  # held-out questions also use words the training sets never saw
    train_words = WORDS[:-6]
    chat = []
    for _ in range(1500):
        question, right, _wrong = task(rng, train_words)
        chat.append({"messages": conversation(question, right)})
    write("chat.jsonl", chat)

    def pairs(n: int, words: list[str]) -> list[dict]:
        out = []
        for _ in range(n):
            question, right, wrong = task(rng, words)
            rejected = rng.choice(REFUSALS) if rng.random() < 0.5 else wrong
            out.append({"chosen": conversation(question, right), "rejected": conversation(question, rejected)})
        return out

    write("preferences.jsonl", pairs(800, train_words))
    write("preferences-heldout.jsonl", pairs(200, held_out_words + [w + "s" for w in held_out_words]))
    assert all(c in string.printable for c in (HERE / "chat.jsonl").read_text())
    write_rl_sets(random.Random(53))


def write_rl_sets(rng: random.Random) -> None:
    """The RL recipe's sums of numbers below 20: 100 held-out pairs (a, b), and the SFT conversations and RL prompts
    drawn from the other 300 (asked as the chat set asks sums). Three SFT answers in five add a remark that ends with
    another number ("Checked 2 times."), which the exact-answer reward (the last number) counts as a wrong answer: the
    fine-tuned model mostly answers so, and RL has a habit to unlearn that carries over to questions it never saw."""
    pairs = [(a, b) for a in range(20) for b in range(20)]
    rng.shuffle(pairs)
    held_out, train = pairs[:100], pairs[100:]

    def answer(a: int, b: int) -> str:
        plain = f"{a} plus {b} is {a + b}."
        return plain if rng.random() < 0.4 else f"{plain} Checked {rng.randint(2, 3)} times."

    def prompt(a: int, b: int) -> dict:
        return {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}], "ground_truth": str(a + b)}

    sft = [
        conversation(f"What is {a} plus {b}?", answer(a, b)) for a, b in (rng.choice(train) for _ in range(1500))
    ]
    write("rl-sft.jsonl", [{"messages": messages} for messages in sft])
    write("rl-prompts.jsonl", [prompt(*rng.choice(train)) for _ in range(2000)])
    write("rl-heldout.jsonl", [prompt(a, b) for a, b in held_out])


if __name__ == "__main__":
    main()
