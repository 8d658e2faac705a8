"""Sixteen varied prompts (about 10 to 1,000 tokens) and their greedy lengths, shared by tests."""

_TOPICS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain how a bicycle stays upright.",
    "List three prime numbers larger than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet.",
    "How many legs does a spider have?",
    "Describe the water cycle for a child.",
    "Write a limerick about a cat.",
]
_LONG = ("The history of computing spans centuries, from the abacus to mechanical calculators, "
         "punched cards, vacuum tubes, transistors and integrated circuits. ")


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for i, topic in enumerate(_TOPICS):
        content = topic if i % 4 else (_LONG * (2 + 4 * i)) + topic
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    # four raw-text prompts, the shortest about ten tokens
    for text in ["Once upon a time, in a small village by the sea, there was",
                 "The quick brown fox jumps over the lazy dog, and then",
                 "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                 "The three largest cities in Europe by population are"]:
        prompts.append(tokenizer.encode(text))
    return prompts


def max_tokens_for(i: int) -> int:
    return 6 + (i * 7) % 27
