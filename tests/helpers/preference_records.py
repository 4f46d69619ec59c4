"""Preference records in TRL's four formats (explicit and implicit prompt, plain text and conversational), for the
DPO tests."""


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


RECORDS = {
    "explicit": [
        {"prompt": "What is 2+2?", "chosen": " It is 4.", "rejected": " Five"},
        {"prompt": "user model", "chosen": "\nSure, go on", "rejected": "\nIt is"},
        {"prompt": "Name a colour: ", "chosen": "blue<end_of_turn>", "rejected": "a long answer, not a colour"},
        {"prompt": "Say yes", "chosen": " yes", "rejected": " no way"},
    ],
    "implicit": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green, often."},
        {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
        {"chosen": "same start", "rejected": "same start and more"},  # one a prefix of the other: TRL's quirk
    ],
    "conversational": [
        {"prompt": [user("Hi")], "chosen": [assistant("Sure thing")], "rejected": [assistant("No.")]},
        {"prompt": [{"role": "system", "content": "Be brief."}, user(" What is 2+2? "), assistant("It is 4. "),
                    user("And 3+3?")],
         "chosen": [assistant("Sure: 6")], "rejected": [assistant("It is seven, I think")]},
        {"prompt": [user("user model\n\nuse")], "chosen": [assistant("model\nSure\n\n")],
         "rejected": [assistant("")]},
        {"prompt": [user("Colour?")], "chosen": [assistant("Blue")], "rejected": [assistant("Green, or red")]},
    ],
    "conversational_implicit": [
        {"chosen": [user("Hi"), assistant("Sure thing")], "rejected": [user("Hi"), assistant("Never")]},
        {"chosen": [user("a"), assistant("b"), user("c"), assistant("d")],
         "rejected": [user("a"), assistant("b"), user("c"), assistant("e, f")]},
    ],
}
