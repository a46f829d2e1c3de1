"""The user's habits, checked: boundary checks of the constructor's arguments, what an optimizer
class needs, params replaced after wrapping, and the wrapped torch optimizer kept from stepping,
saving or loading behind the wrapper."""
