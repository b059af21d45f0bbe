"""Conversations: chat templates rendered as transformers renders them, a conversation's tokens
and loss mask, and packing conversations into whole training windows.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.data.chat.conversation import Conversation, check_messages, conversation_of
from kempnerforge.data.chat.encoding import (
    encode_conversations,
    encode_with_offsets,
    end_of_turn_ids,
)
from kempnerforge.data.chat.packing import ConversationPacker, Packing, packing_mismatch
from kempnerforge.data.chat.template import (
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatTemplate,
    load_chat_template,
)
from kempnerforge.data.chat.turns import ConversationRefused

__all__ = [
    "ChatTemplate",
    "Conversation",
    "ConversationPacker",
    "ConversationRefused",
    "Packing",
    "TEMPLATE_FILE",
    "TOKENIZER_CONFIG",
    "check_messages",
    "conversation_of",
    "encode_conversations",
    "encode_with_offsets",
    "end_of_turn_ids",
    "load_chat_template",
    "packing_mismatch",
]
