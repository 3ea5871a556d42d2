"""Chat prompts for the default model: a fixed held-out set (chat and code, never trained on) that
the dtype measurements and the draft's evaluation use, and training prompts for distilling the
draft, built from templates over topics that the held-out set does not use."""

from __future__ import annotations

import random

HELDOUT_CHAT = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Explain photosynthesis to a ten-year-old.",
    "What are three tips for sleeping better?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Give me a short packing list for a weekend camping trip.",
    "What is the difference between weather and climate?",
    "Write a polite email declining a meeting invitation.",
    "How many days are there in a leap year, and why?",
    "Suggest a name for a bakery that sells only bread.",
    "What does a compiler do?",
    "Translate 'good morning, how are you?' into Spanish.",
    "List four planets of the solar system and one fact about each.",
    "How do vaccines work?",
    "Write a limerick about a cat who loves coffee.",
    "What is 17 multiplied by 23?",
    "Give me a recipe for a simple tomato soup.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in a few steps.",
]

HELDOUT_CODE = [
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "How do I read a CSV file in Python?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python class for a stack with push, pop and peek.",
    "How do I sort a dictionary by its values in Python?",
    "Write a SQL query that counts the orders per customer.",
    "Write a JavaScript function that removes duplicates from an array.",
    "What is the difference between a tuple and a list in Python?",
    "Write a Python function that merges two sorted lists.",
    "Write a bash command that counts the lines of every .py file in a directory.",
    "How do I handle exceptions in Python? Show an example.",
    "Write a Python function that counts the words in a text.",
    "Write a binary search in Python.",
    "What does the `yield` keyword do in Python?",
    "Write a Python script that prints the numbers from 1 to 100, with Fizz for multiples of 3 and Buzz for multiples of 5.",
    "Write a regular expression that matches an email address.",
    "Write a C function that returns the length of a string.",
    "Explain recursion with a short Python example.",
]

HELDOUT = HELDOUT_CHAT + HELDOUT_CODE

# training prompts: topics and tasks disjoint from the held-out set above
_TOPICS = [
    "volcanoes", "the Roman Empire", "black holes", "honey bees", "the printing press", "glaciers",
    "the human heart", "electric cars", "the stock market", "coral reefs", "the Moon landing",
    "rainbows", "earthquakes", "the internet", "dinosaurs", "chess", "the French Revolution",
    "solar panels", "jazz music", "the Great Wall of China", "penguins", "bread baking", "tides",
    "the immune system", "democracy", "recycling", "the Olympic Games", "magnets", "tea",
    "the Amazon rainforest", "batteries", "owls", "the Renaissance", "clouds", "bicycles", "sharks",
    "the Pyramids of Giza", "wind turbines", "memory in the brain", "gravity", "deserts", "coffee",
    "the Silk Road", "antibiotics", "lightning", "whales", "the periodic table", "trains", "maps",
]
_TOPIC_TEMPLATES = [
    "Tell me about {t}.", "Explain {t} in simple terms.", "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.", "What should a beginner know about {t}?",
    "Write a paragraph for a school report on {t}.", "What are common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.", "Write a short story that involves {t}.",
    "What questions could a quiz about {t} ask?",
]
_CODE_TASKS = [
    "computes the factorial of a number", "finds the largest element of a list",
    "checks whether a string is a palindrome", "flattens a nested list", "counts the vowels in a string",
    "converts Celsius to Fahrenheit", "returns the unique elements of a list in order",
    "computes the greatest common divisor of two numbers", "transposes a matrix",
    "checks whether two strings are anagrams", "reads a text file and prints its longest line",
    "generates all permutations of a list", "computes the average of a list of numbers",
    "parses a date string in the format YYYY-MM-DD", "rotates a list by k positions",
    "groups words by their first letter", "finds the second smallest number in a list",
    "validates a phone number", "implements a queue with two stacks", "computes the sum of digits of a number",
    "splits a list into chunks of size n", "capitalizes every word of a sentence",
    "finds the most common element of a list", "converts a number to binary",
    "removes punctuation from a string", "implements insertion sort", "checks whether a year is a leap year",
    "computes the dot product of two vectors", "merges two dictionaries", "finds all divisors of a number",
]
_CODE_TEMPLATES = [
    "Write a Python function that {t}.", "Write a JavaScript function that {t}.",
    "Show me Python code that {t}, with a docstring.", "Write a Python function that {t}, and explain it.",
    "Write a Go function that {t}.", "Write a Python function that {t}, with a short test.",
]


def training_prompts(seed: int = 0) -> list[str]:
    """Every template over every topic and task (about 680 prompts), shuffled."""
    prompts = [t.format(t=topic) for t in _TOPIC_TEMPLATES for topic in _TOPICS]
    prompts += [t.format(t=task) for t in _CODE_TEMPLATES for task in _CODE_TASKS]
    assert not set(prompts) & set(HELDOUT)
    random.Random(seed).shuffle(prompts)
    return prompts


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]
