"""Word pools for the generated tasks: plain English words that the bundled tokenizer keeps as
one or two tokens (checked by tests/test_evaluation.py), so needles stay short and keys differ
in their first token (a model that keys on the first token cannot confuse two keys)."""

from __future__ import annotations

# Needle keys and word values: concrete nouns, distinct first tokens.
KEY_WORDS = tuple("""
apple river candle garden window mountain pencil bottle forest rabbit button castle mirror
dragon island ladder tiger violin wagon anchor basket carpet dolphin engine falcon guitar
hammer jacket kettle lemon magnet needle orange parrot pepper pillow pocket rocket saddle
shovel spider tomato turtle helmet lantern meadow oyster pebble puzzle ribbon sailor
scarf shadow silver spoon tunnel valley wallet wizard zebra cherry cotton desert feather
""".split())

# Value words for word-valued needles: short, unrelated to the keys above.
VALUE_WORDS = tuple("""
red blue green black white brown pink gold gray purple north south east west cold warm
fast slow loud quiet soft hard dark bright sweet sour happy angry empty full early late
""".split())

# Categories for in-context classification: the model must generalise from the labelled
# examples to an unseen member of a category, which takes more than copying.
CATEGORIES = {
    "animal": """dog cat horse cow sheep goat pig lion tiger bear wolf fox deer rabbit mouse
        monkey elephant zebra camel donkey""".split(),
    "fruit": """apple banana orange grape lemon cherry peach pear plum mango melon kiwi lime
        apricot coconut papaya fig berry""".split(),
    "color": """red blue green yellow black white brown pink purple gray violet crimson
        scarlet beige turquoise""".split(),
    "body part": """hand foot head arm leg knee elbow finger toe nose ear eye mouth neck
        shoulder chin lip tooth""".split(),
    "vehicle": """car bus truck train bicycle boat ship plane taxi tram van scooter tractor
        helicopter motorcycle subway""".split(),
    "profession": """teacher doctor nurse farmer lawyer pilot baker chef driver engineer
        painter singer writer dentist soldier judge""".split(),
}

# Filler words for common-words extraction: frequent-looking but interchangeable.
COMMON_WORDS = tuple("""
table chair cloud stone bread grass storm paper glass metal ocean coffee sugar brick field
music smoke honey flame frost beach plant sound light dream tower horse queen piano bridge
clock shirt cable motor fence flour glove juice knife lemon maple nurse onion pearl quilt
radio salad tiger uncle vapor whale yacht acorn badge cabin dairy eagle fairy gravy hotel
""".split())

# RULER's noise sentences (repeated haystack); a short one helps fill a budget exactly.
NOISE_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.",
)
